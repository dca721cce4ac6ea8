/**
 * Notebook 7 (no ILabShell, no status bar by default): the extension activates, the panel
 * opens in the notebook page's right area from the command, and shows the kernel's grant.
 */
import { expect, test } from '@playwright/test';

import { screenshot, SHOTS, TOKEN } from './helpers';
import * as fs from 'fs';

test('the panel works in Notebook 7', async ({ page }) => {
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

  await page.evaluate(async () => {
    await window.jupyterapp.commands.execute('gpupool:open-panel');
  });
  const panel = page.locator('#jupyter-gpupool-panel');
  await expect(panel).toBeVisible();
  await expect(panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge')).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-summary')).toContainText('8 GiB granted on GPU 0');
  await screenshot(page, 'notebook7-panel');
  expect(errors).toEqual([]);
});
