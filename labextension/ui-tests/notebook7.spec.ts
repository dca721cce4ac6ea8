/**
 * Notebook 7 (no ILabShell, no status bar): opened by URL as a user would, the notebook page
 * shows the kernel's slice in its top bar ("GPU 0 / 8 GiB"); clicking it opens the panel in
 * the page's right area, which shows the grant. No command is run.
 */
import { expect, test } from '@playwright/test';

import { screenshot, SHOTS, TOKEN } from './helpers';
import * as fs from 'fs';

test('Notebook 7 shows the slice in the top bar, and it opens the panel', async ({ page }) => {
  fs.mkdirSync(SHOTS, { recursive: true });
  const errors: string[] = [];
  page.on('console', msg => {
    if (msg.type() === 'error' && /gpupool/i.test(msg.text())) {
      errors.push(msg.text());
    }
    if (process.env.GPUPOOL_UI_DEBUG) {
      console.log(`browser ${msg.type()}: ${msg.text()}`);
    }
  });
  await page.goto(`notebooks/a.ipynb?token=${TOKEN}`);
  await page.waitForFunction(() => !!window.jupyterapp?.restored, null, { timeout: 60 * 1000 });
  await page.evaluate(async () => {
    await window.jupyterapp.restored;
  });
  expect(await page.evaluate(() => window.jupyterapp.hasPlugin('jupyter-gpupool:plugin'))).toBe(true);
  expect(await page.evaluate(() => window.jupyterapp.isPluginActivated('jupyter-gpupool:plugin'))).toBe(true);

  // The indicator is in the page's top area, without running any command.
  const indicator = page.locator('.jp-GpuPool-topBar');
  await expect(indicator).toBeVisible({ timeout: 60 * 1000 });
  await expect(indicator).toHaveText(/^GPU .* \/ 8 GiB/, { timeout: 60 * 1000 });
  await screenshot(page, 'notebook7-topbar');
  await indicator.click();
  const panel = page.locator('#jupyter-gpupool-panel');
  await expect(panel).toBeVisible();
  await expect(panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge')).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-summary')).toContainText('8 GiB granted on GPU 0');
  await screenshot(page, 'notebook7-panel');
  expect(errors).toEqual([]);
});
