/**
 * Memory used outside the pool: a process started without a lease (a terminal's python on the
 * simulated 1x16GiB pool) holds 3 GiB of the GPU. The server's watchdog sees it, and the sidebar
 * draws it as its own "outside the pool" segment after the notebook's 8 GiB slice, with free
 * memory shrunk by it and the process listed as the pool view lets this user see it; once the
 * process is gone, the segment goes too.
 */
import { expect, test } from '@playwright/test';
import { ChildProcess, spawn } from 'child_process';

import { api, openLab, openNotebook, screenshot } from './helpers';

const PYTHON = process.env.GPUPOOL_UI_PYTHON || 'python';
const REPO = process.env.GPUPOOL_UI_REPO || '';
const DB = process.env.GPUPOOL_UI_DB || '';

/** A python that pretends to hold `size` of GPU `uuid` (as a CUDA program would), without a lease. */
function startOutsideThePool(uuid: string, size: string): ChildProcess {
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    GPUPOOL_SIMULATE: process.env.GPUPOOL_SIMULATE || '1x16GiB',
    GPUPOOL_DB: DB,
    CUDA_VISIBLE_DEVICES: uuid,
    PYTHONPATH: REPO
  };
  delete env.GPUPOOL_LEASE_ID;
  return spawn(
    PYTHON,
    ['-c', `from jupyter_gpupool.devices.simulated import pretend_to_use; import time; pretend_to_use(${JSON.stringify(size)}); time.sleep(300)`],
    { env, stdio: 'inherit' }
  );
}

test('memory used outside the pool is its own segment of the bar, and free memory shrinks by it', async ({ page, request }) => {
  expect(DB, 'GPUPOOL_UI_DB is set (run ui-tests/run.sh)').not.toBe('');
  await openLab(page);
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  await expect(panel).toBeVisible();
  const deviceText = panel.locator('.jp-GpuPool-deviceText').first();
  await expect(deviceText).toContainText('8 GiB of 16 GiB leased, 8 GiB free');
  await expect(panel.locator('.jp-GpuPool-segment.jp-mod-outside')).toHaveCount(0);

  const uuid = (await (await api(request, 'api/gpupool/pool')).json()).devices[0].uuid as string;
  const outside = startOutsideThePool(uuid, '3GiB');
  try {
    const segment = panel.locator('.jp-GpuPool-segment.jp-mod-outside');
    await expect(segment).toHaveCount(1, { timeout: 30 * 1000 });
    await expect(segment).toHaveAttribute('title', 'outside the pool: 3 GiB');
    await expect(deviceText).toContainText('8 GiB of 16 GiB leased, 3 GiB used outside the pool, 5 GiB free');
    await expect(panel.locator('.jp-GpuPool-legend')).toContainText('outside the pool');
    // Whose it is, as the server lets this user see it: the pid where shown, else only how much.
    const view = await (await api(request, 'api/gpupool/pool')).json();
    const item = view.unpooled.find((u: any) => u.bytes === 3 * 1024 ** 3);
    expect(item, 'GET /api/gpupool/pool lists the process').toBeTruthy();
    const list = panel.locator('.jp-GpuPool-outside li');
    if (item.pid !== null) {
      expect(item.pid).toBe(outside.pid);
      await expect(list.first()).toContainText(`pid ${outside.pid}`);
      await expect(list.first()).toContainText(`— 3 GiB (${item.why})`);
    } else {
      await expect(list.first()).toHaveText('3 GiB used outside the pool');
    }
    const width = await segment.evaluate(node => (node as HTMLElement).style.width);
    expect(parseFloat(width)).toBeCloseTo((100 * 3) / 16, 3);
    await screenshot(page, 'unpooled-outside-the-pool');
  } finally {
    outside.kill('SIGKILL');
  }
  // The process is gone: the next sighting no longer has it, and the memory is free again.
  await expect(panel.locator('.jp-GpuPool-segment.jp-mod-outside')).toHaveCount(0, { timeout: 30 * 1000 });
  await expect(deviceText).toContainText('8 GiB of 16 GiB leased, 8 GiB free');
});
