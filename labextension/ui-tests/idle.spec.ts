/**
 * Idle reclaim as the user sees it (server started by run.sh with
 * GPUPOOL_IDLE_POLICY=always, a 3 s idle timeout and a 10 s warning): an idle slice shows
 * a countdown with Keep; Keep stops it; a slice not kept goes back and the panel says why.
 */
import { expect, test } from '@playwright/test';

import { COUNTDOWN_DEADLINE, kernelQuiet, openLab, openNotebook, screenshot } from './helpers';

test('an idle slice counts down, Keep holds it, and a reclaim says why', async ({ page }) => {
  await openLab(page);

  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const idle = panel.locator('.jp-GpuPool-idle');

  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  await expect(panel).toBeVisible();

  // Idle for 3 s: warned, with a countdown in the panel and the status bar (the idle clock starts
  // once the kernel has started and gone quiet, slow on a loaded machine).
  await kernelQuiet(page);
  await expect(idle).toBeVisible({ timeout: COUNTDOWN_DEADLINE });
  await expect(idle).toContainText(/slice goes back to the pool in 0:\d\d unless you keep it/);
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB · 0:\d\d$/);
  await screenshot(page, 'idle-01-countdown');

  // Keep: the countdown goes away and the panel says for how long it is kept.
  await idle.getByRole('button', { name: 'Keep the slice for 1h' }).click();
  await expect(idle).toBeHidden();
  await expect(panel.locator('.jp-GpuPool-kept')).toHaveText(/^kept through idle for another (59 min|1 h)/);
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB$/);
  await screenshot(page, 'idle-02-kept');

  // A second kernel left idle: warned, then reclaimed; the panel tells why.
  await openNotebook(page, 'b.ipynb');
  await kernelQuiet(page);
  await expect(idle).toBeVisible({ timeout: COUNTDOWN_DEADLINE });
  await expect(panel.locator('.jp-GpuPool-released')).toBeVisible({ timeout: COUNTDOWN_DEADLINE });
  await expect(panel.locator('.jp-GpuPool-released')).toContainText(/idle/i);
  await expect(status).toHaveText('GPU released');
  await screenshot(page, 'idle-03-reclaimed');

  // The kept kernel still holds its slice.
  await page.locator('#jp-main-dock-panel .lm-TabBar-tab', { hasText: 'a.ipynb' }).click();
  await expect(panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge')).toHaveText('granted');

  // Dark theme: the panel uses JupyterLab's theme variables only.
  await page.evaluate(async () => {
    await window.jupyterapp.commands.execute('apputils:change-theme', { theme: 'JupyterLab Dark' });
  });
  await expect(page.locator('body[data-jp-theme-light="false"]')).toBeAttached();
  await screenshot(page, 'idle-04-dark-theme');
});
