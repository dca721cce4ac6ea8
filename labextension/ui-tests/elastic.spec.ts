/**
 * Elastic slices in the sidebar: on a simulated 1x16GiB pool with a 2 GiB default that may grow
 * to 16 GiB (GPUPOOL_BURST=16GiB), kernel A uses 6 GiB (`pretend_to_use`, which a framework cap's
 * allocation does on a real GPU): its slice grows and the sidebar shows
 * `2 GiB guaranteed · 6.x GiB now, up to 16 GiB`. A's use drops to 1 GiB and a second notebook,
 * whose kernelspec asks for 12 GiB, starts: it is granted, and A's line is back near its guarantee,
 * with the pool's reason.
 *
 * Run by `ui-tests/run.sh elastic` (GPUPOOL_DEFAULT_MEMORY=2GiB GPUPOOL_BURST=16GiB, a 12 GiB kernelspec).
 */
import { APIRequestContext, expect, Locator, Page, test } from '@playwright/test';

import { api, kernelOf, openLab, openNotebook, screenshot } from './helpers';

const USE = 'from jupyter_gpupool.devices.simulated import pretend_to_use\n';

/** Run `code` in the kernel of the current notebook (as its cell would); its error, if any, fails the test. */
async function runInKernel(page: Page, code: string): Promise<void> {
  const outcome = await page.evaluate(async source => {
    const context = window.jupyterapp.shell.currentWidget.sessionContext;
    await context.ready;
    const future = context.session.kernel.requestExecute({ code: source, store_history: false });
    let error = '';
    future.onIOPub = (msg: any) => {
      if (msg.header.msg_type === 'error') {
        error = `${msg.content.ename}: ${msg.content.evalue}`;
      }
    };
    const reply = await future.done;
    return error || reply.content.status;
  }, code);
  expect(outcome).toBe('ok');
}

/** The GiB "now" of the sidebar's elastic line, 0 while there is none. */
async function nowGiB(line: Locator): Promise<number> {
  if ((await line.count()) === 0) {
    return 0;
  }
  const match = /· ([\d.]+) GiB now,/.exec(await line.innerText());
  return match ? parseFloat(match[1]) : 0;
}

async function kernelStatus(request: APIRequestContext, kernelId: string): Promise<any> {
  return (await api(request, `api/gpupool/kernels/${kernelId}`)).json();
}

test('an elastic slice grows with its use and gives its burst back for a request', async ({ page, request }) => {
  await openLab(page);
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const line = panel.locator('.jp-GpuPool-elasticLine');
  const step = panel.locator('.jp-GpuPool-burstStep');
  const showTab = (notebook: string) =>
    page.locator('#jp-main-dock-panel .lm-TabBar-tab', { hasText: notebook }).click();

  // 1. A asks for the default: 2 GiB guaranteed, up to the whole GPU.
  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 2 GiB/);
  await status.click();
  await expect(panel).toBeVisible();
  await expect(line).toHaveText('2 GiB guaranteed · 2 GiB now, up to 16 GiB');
  const kernelA = await kernelOf(request, 'a.ipynb');
  await screenshot(page, 'elastic-01-default-slice');

  // 2. A uses 6 GiB: the slice grows within seconds, and the sidebar says so in %gpupool status's words.
  const asked = Date.now();
  await runInKernel(page, USE + "pretend_to_use('6GiB')");
  await expect.poll(() => nowGiB(line), { timeout: 15 * 1000, message: "A's line shows the grown slice" }).toBeGreaterThanOrEqual(6);
  console.log(`A grown to ${await nowGiB(line)} GiB in the sidebar ${((Date.now() - asked) / 1000).toFixed(1)} s after its cell started`);
  await expect(line).toHaveText(/^2 GiB guaranteed · [\d.]+ GiB now, up to 16 GiB$/);
  await expect(step).toContainText('grown to');
  await expect(status).toHaveAttribute('title', /^2 GiB guaranteed · [\d.]+ GiB now, up to 16 GiB; GPU 0/);
  // The watchdog measured the 6 GiB: within its slice's limit, so no warning.
  await expect(panel.locator('.jp-GpuPool-usage')).toContainText(/^using 6 GiB of [\d.]+ GiB/, { timeout: 15 * 1000 });
  await expect(panel.locator('.jp-GpuPool-warning')).toHaveCount(0);
  const grown = await kernelStatus(request, kernelA);
  expect(grown.state).toBe('granted');
  expect(grown.memory).toBeGreaterThanOrEqual(6 * 1024 ** 3);
  await screenshot(page, 'elastic-02-grown-on-demand');

  // 3. A's use drops to 1 GiB; a notebook whose kernelspec asks for 12 GiB starts: it is granted.
  await runInKernel(page, USE + "pretend_to_use('1GiB')");
  await expect.poll(async () => (await kernelStatus(request, kernelA)).used_memory, { timeout: 15 * 1000 }).toBeLessThanOrEqual(1024 ** 3);
  const started = Date.now();
  await openNotebook(page, 'python3-12gib.ipynb');
  const kernelB = await kernelOf(request, 'python3-12gib.ipynb');
  await expect.poll(async () => (await kernelStatus(request, kernelB)).state, { timeout: 20 * 1000 }).toBe('granted');
  console.log(`the 12 GiB kernel was granted ${((Date.now() - started) / 1000).toFixed(1)} s after its notebook opened`);
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 12 GiB/);
  await screenshot(page, 'elastic-03-second-kernel-granted');

  // 4. Back on A: its line is back near its guarantee, with the pool's reason.
  await showTab('a.ipynb');
  await expect.poll(() => nowGiB(line), { timeout: 15 * 1000, message: "A's line back near its guarantee" }).toBeLessThanOrEqual(4);
  expect(await nowGiB(line)).toBeGreaterThanOrEqual(2);
  await expect(line).toHaveText(/^2 GiB guaranteed · [\d.]+ GiB now, up to 16 GiB$/);
  await expect(step).toHaveText(/^(burst taken back for a request of 12 GiB|gave its burst back)/);
  const back = await kernelStatus(request, kernelA);
  expect([back.state, back.guarantee]).toEqual(['granted', 2 * 1024 ** 3]);
  expect(back.memory).toBeLessThanOrEqual(4 * 1024 ** 3);
  await screenshot(page, 'elastic-04-burst-given-back');
});
