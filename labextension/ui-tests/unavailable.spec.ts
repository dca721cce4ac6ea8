/**
 * A server whose pool cannot open (its pool file is not a pool): the status bar says
 * "GPU pool unavailable" before any notebook is open, the panel gives the reason and what
 * kernels do meanwhile, and a notebook's kernel runs CPU-only, saying so.
 */
import { expect, test } from '@playwright/test';

import { openLab, openNotebook, screenshot } from './helpers';

test('an unavailable pool shows in the status bar and the panel, with the reason', async ({ page }) => {
  await openLab(page);
  const status = page.locator('#jp-main-statusbar .jp-GpuPool-status');
  await expect(status).toContainText('GPU pool unavailable', { timeout: 30 * 1000 });
  const title = (await status.getAttribute('title')) ?? '';
  expect(title).toMatch(/^GPU pool unavailable: .+; kernels run CPU-only/);

  await status.click();
  const panel = page.locator('#jupyter-gpupool-panel');
  await expect(panel).toBeVisible();
  const alert = panel.locator('.jp-GpuPool-unavailable');
  await expect(alert.locator('strong')).toHaveText('GPU pool unavailable');
  await expect(alert.locator('p').first()).not.toBeEmpty();
  await expect(alert).toContainText('Kernels run CPU-only');
  await screenshot(page, 'unavailable-panel');

  // A kernel started meanwhile runs without a GPU, and the panel says so.
  await openNotebook(page, 'a.ipynb');
  await expect(panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge')).toHaveText('CPU only', { timeout: 60 * 1000 });
  await expect(panel.locator('.jp-GpuPool-summary')).toContainText('this kernel runs CPU-only');
  await expect(status).toContainText('GPU pool unavailable');
  await screenshot(page, 'unavailable-cpu-only');
});
