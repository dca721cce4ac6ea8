/**
 * Resume ahead of the cell: on a simulated 1x16GiB pool with 8 GiB slices, kernel A is suspended
 * while its notebook is in the background; focusing A's notebook asks for its resume at once
 * (`POST .../resume {"ahead": true}`), so the kernel is restored before any cell runs: its cell
 * keeps its empty prompt, and the sidebar shows it granted again. An edit of a cell does the same.
 *
 * Run by `ui-tests/run.sh resume-ahead` (GPUPOOL_RECLAIM_ACTION=suspend).
 */
import { APIRequestContext, expect, test } from '@playwright/test';

import { api, kernelOf, openLab, openNotebook, screenshot, TOKEN } from './helpers';

async function kernelStatus(request: APIRequestContext, kernelId: string): Promise<any> {
  return (await api(request, `api/gpupool/kernels/${kernelId}`)).json();
}

async function suspend(request: APIRequestContext, kernelId: string): Promise<void> {
  const answer = await request.post(`api/gpupool/kernels/${kernelId}/suspend`, {
    headers: { Authorization: `token ${TOKEN}` },
    data: {}
  });
  expect(answer.status(), await answer.text()).toBe(200);
  await expect.poll(async () => (await kernelStatus(request, kernelId)).state, { timeout: 20 * 1000 }).toBe('suspended');
}

test("focusing a suspended kernel's notebook starts its resume before a cell runs", async ({ page, request }) => {
  await openLab(page);
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const badge = panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge');
  const showTab = (notebook: string) =>
    page.locator('#jp-main-dock-panel .lm-TabBar-tab', { hasText: notebook }).click();
  const history: string[] = [];
  let kernelA = '';
  const watch = setInterval(async () => {
    if (!kernelA) {
      return;
    }
    try {
      const s = await kernelStatus(request, kernelA);
      const state = s.transition ? `${s.state} (${s.transition})` : s.state === 'queued' && s.resuming ? 'queued (resuming)' : s.state;
      if (history[history.length - 1] !== state) {
        history.push(state);
      }
    } catch {
      // the page is closing
    }
  }, 50);

  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  await expect(panel).toBeVisible();
  kernelA = await kernelOf(request, 'a.ipynb');
  await openNotebook(page, 'b.ipynb'); // A's notebook goes to the background
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);

  // 1. A is suspended while its notebook is not the current one.
  await suspend(request, kernelA);
  await screenshot(page, 'resume-ahead-01-a-suspended-in-the-background');

  // 2. The user comes back to A's notebook: no cell is run, and A is restored.
  await showTab('a.ipynb');
  await expect
    .poll(async () => {
      const s = await kernelStatus(request, kernelA);
      return `${s.state} ${s.transition ?? 'none'}`;
    }, { timeout: 15 * 1000 })
    .toBe('granted none');
  await expect(badge).toHaveText('granted');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB$/);
  const prompt = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-InputPrompt').first();
  await expect(prompt).toHaveText(/^\[\s*\]:$/); // the notebook's cell never ran
  await screenshot(page, 'resume-ahead-02-restored-on-focus');
  expect(history).toContain('suspended');
  expect(history[history.length - 1]).toBe('granted');

  // 3. Suspended again, with its notebook current: editing a cell starts the resume too.
  await suspend(request, kernelA);
  await page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .cm-content').first().click();
  await page.keyboard.type('# back to work\n');
  await expect
    .poll(async () => (await kernelStatus(request, kernelA)).state, { timeout: 15 * 1000 })
    .toBe('granted');
  await expect(prompt).toHaveText(/^\[\s*\]:$/);
  await screenshot(page, 'resume-ahead-03-restored-on-edit');
  clearInterval(watch);
  console.log(`REST state of A: ${history.join(' → ')}`);
});
