/**
 * Issue 4, "Must show": on a simulated 1x16GiB pool with an 8 GiB default,
 * two notebooks are granted (panel and status bar), a third is queued at position 1,
 * shutting a granted kernel down grants the third within seconds, and the reserve,
 * Keep and Release actions act. Screenshots of each step go to $GPUPOOL_UI_SCREENSHOTS
 * (default ui-tests/screenshots).
 */
import { expect, test } from '@playwright/test';

import { kernelOf, openLab, openNotebook, screenshot, TOKEN } from './helpers';

/** How long the third kernel may take to be granted after a shutdown. */
const GRANT_WITHIN_MS = Number(process.env.GPUPOOL_UI_GRANT_WITHIN_MS || 10000);

test('sidebar and status bar follow grants, the queue, Keep and Release', async ({ page, request }) => {

  await openLab(page);
  await expect(page.locator('#jp-main-statusbar')).toBeVisible();

  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const leaseBadge = panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge');

  // The panel has its own labelled tab in the right sidebar.
  await expect(page.locator('.jp-SideBar.jp-mod-right [title^="GPU pool"]').first()).toBeVisible();

  // 1. First notebook: granted, shown in the status bar; a click opens the panel.
  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  await expect(panel).toBeVisible();
  await expect(leaseBadge).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-summary')).toContainText('8 GiB granted on GPU 0');
  await expect(panel.getByRole('meter', { name: "Slice of the GPU's memory" })).toHaveAttribute(
    'aria-valuetext',
    'slice 8 GiB of 16 GiB (50%)'
  );
  await expect(panel.locator('.jp-GpuPool-enforcement')).toBeVisible();
  const kernelA = await kernelOf(request, 'a.ipynb');
  await screenshot(page, '01-first-granted');

  // 2. Second notebook: granted too; the pool shows the GPU full, both slices mine.
  await openNotebook(page, 'b.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await expect(leaseBadge).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-segment.jp-mod-mine')).toHaveCount(2);
  await expect(panel.locator('.jp-GpuPool-segment.jp-mod-current')).toHaveCount(1);
  await expect(panel.locator('.jp-GpuPool-deviceText').first()).toContainText('16 GiB of 16 GiB leased, 0 B free');
  await screenshot(page, '02-second-granted');

  // 3. Third notebook: queued at position 1; the kernel start shows why it waits.
  await openNotebook(page, 'c.ipynb');
  await expect(status).toHaveText('GPU queued #1');
  await expect(leaseBadge).toHaveText('queued');
  await expect(panel.locator('.jp-GpuPool-queueText')).toHaveText(/^waiting for a GPU — position 1 of 1, /);
  await expect(panel.locator('.jp-GpuPool-queueLength')).toContainText('1 waiting');
  await screenshot(page, '03-third-queued');

  // 4. Shut the first kernel down: the third is granted within seconds.
  const stopped = Date.now();
  const response = await request.delete(`api/kernels/${kernelA}`, {
    headers: { Authorization: `token ${TOKEN}` }
  });
  expect(response.status()).toBe(204);
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/, { timeout: GRANT_WITHIN_MS });
  const grantedAfter = Date.now() - stopped;
  console.log(`third kernel shown granted ${grantedAfter} ms after the shutdown`);
  await expect(leaseBadge).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-queueLength')).toContainText('no one waiting');
  await screenshot(page, '04-third-granted-after-shutdown');

  // 4b. Live usage and right-sizing: the kernel (on the simulated pool) pretends to hold 1 GiB;
  // the real watchdog sees it, the bar and status bar show it, and one click shrinks the slice.
  const editor = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .jp-InputArea-editor').first();
  await editor.click();
  await page.keyboard.press('Control+A');
  await page.keyboard.type("from jupyter_gpupool.devices.simulated import pretend_to_use; pretend_to_use('1GiB')");
  await page.keyboard.press('Shift+Enter');
  await expect(status).toHaveText(/^GPU 1 \/ 8 GiB/, { timeout: 20000 });
  const hint = panel.locator('.jp-GpuPool-hint');
  await expect(hint).toContainText('peaked at 1 GiB of 8 — shrink to 2 GiB?', { timeout: 20000 });
  await screenshot(page, '04b-usage-and-right-sizing-hint');
  await hint.getByRole('button', { name: 'Shrink to 2 GiB' }).click();
  await expect(status).toHaveText(/^GPU 1 \/ 2 GiB/);
  await expect(hint).toHaveCount(0);

  // 5. Reserve: a bad size is refused before sending, naming the forms; a good one shrinks.
  const size = panel.getByLabel('Size');
  await size.fill('lots');
  await size.blur();
  await expect(panel.locator('#jp-GpuPool-sizeError')).toContainText('expected a size like 8GiB, 8G, 8GB, 512MiB');
  await expect(size).toHaveAttribute('aria-invalid', 'true');
  await expect(panel.getByRole('button', { name: 'Reserve' })).toBeDisabled();
  await screenshot(page, '05-reserve-invalid');
  await size.fill('4GiB');
  await panel.getByLabel('Hold for').fill('30m');
  await panel.getByRole('button', { name: 'Reserve' }).click();
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 4 GiB/);
  await expect(panel.locator('.jp-GpuPool-message')).toHaveText('Reserved: 4GiB, held for 30m.');
  await screenshot(page, '06-reserved-4gib');

  // 6. Keep: holds the slice through idle.
  await panel.getByRole('button', { name: /^Keep 1h$/ }).click();
  await expect(panel.locator('.jp-GpuPool-message')).toHaveText('Kept through idle for 1h.');
  await expect(panel.locator('.jp-GpuPool-kept')).toHaveText(/^kept through idle for another (59 min|1 h)/);
  await screenshot(page, '07-kept');

  // 7. Release: after confirming, the slice goes back and the panel says why.
  await panel.getByRole('button', { name: 'Release', exact: true }).click();
  const dialog = page.locator('.jp-Dialog');
  await expect(dialog).toContainText('Release the GPU slice?');
  await screenshot(page, '08-release-confirm');
  await dialog.getByRole('button', { name: 'Release' }).click();
  await expect(leaseBadge).toHaveText('released');
  await expect(status).toHaveText('GPU released');
  await expect(panel.locator('.jp-GpuPool-released')).toContainText('released by user');
  await expect(panel.locator('.jp-GpuPool-segment.jp-mod-mine')).toHaveCount(1);
  await screenshot(page, '09-released');

  // The status bar is keyboard-operable: Enter on it opens the panel again.
  await page.evaluate(() => window.jupyterapp.shell.collapseRight?.());
  await status.focus();
  await page.keyboard.press('Enter');
  await expect(panel).toBeVisible();
});
