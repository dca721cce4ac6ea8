/**
 * Resume ahead of the cell, and looking never resumes: on a simulated 1x16GiB pool with 8 GiB
 * slices, kernel A is suspended while its notebook is in the background. Coming back to A's
 * notebook only looks: A stays suspended. Typing `%gpupool status` key by key and running it
 * looks too: A stays suspended, and the cell's answer says so. Typing `x = 1` is work: the edit
 * asks for A's resume at once (`POST .../resume {"ahead": true}`), and running the cell finds A
 * granted again.
 *
 * Run by `ui-tests/run.sh resume-ahead` (GPUPOOL_RECLAIM_ACTION=suspend).
 */
import { APIRequestContext, expect, Locator, test } from '@playwright/test';

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

/**
 * Type `text` key by key into cell `index` once its editor has the focus: on a loaded host the
 * cell made by `b` or Shift+Enter gets its editor later than the key that made it, and keys
 * typed before would be lost.
 */
async function typeInCell(notebook: Locator, index: number, text: string): Promise<void> {
  const editor = notebook.locator('.jp-Cell').nth(index).locator('.cm-content');
  await expect(editor).toBeFocused();
  await editor.page().keyboard.type(text, { delay: 30 });
  await expect(editor).toHaveText(text);
}

test("looking at a suspended kernel's notebook never resumes it; editing a cell of work does", async ({ page, request }) => {
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

  // 2. The user comes back to A's notebook: it only looks, and A stays suspended.
  await showTab('a.ipynb');
  await expect(badge).toHaveText('suspended', { timeout: 15 * 1000 });
  expect((await kernelStatus(request, kernelA)).state).toBe('suspended');
  await screenshot(page, 'resume-ahead-02-looking-after-the-suspend');

  // 3. `%gpupool status`, typed key by key in a new cell and run, only looks too.
  const notebook = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden)');
  await notebook.locator('.jp-Cell .cm-content').first().click();
  await page.keyboard.press('Escape');
  await page.keyboard.press('b'); // a new cell below
  await page.keyboard.press('Enter');
  await typeInCell(notebook, 1, '%gpupool status');
  await page.keyboard.press('Shift+Enter');
  await expect(notebook.locator('.jp-Cell').nth(1).locator('.jp-OutputArea-output')).toContainText('suspended', {
    timeout: 30 * 1000
  });
  expect((await kernelStatus(request, kernelA)).state).toBe('suspended');
  expect(history[history.length - 1]).toBe('suspended');
  await screenshot(page, 'resume-ahead-03-status-looks-without-resuming');

  // 4. `x = 1` typed in the next cell is work: the resume starts with the edit, and the cell runs on a granted kernel.
  await typeInCell(notebook, 2, 'x = 1'); // Shift+Enter made this cell and put it in edit mode
  await expect
    .poll(async () => (await kernelStatus(request, kernelA)).state, { timeout: 15 * 1000 })
    .not.toBe('suspended');
  await page.keyboard.press('Shift+Enter');
  await expect
    .poll(async () => {
      const s = await kernelStatus(request, kernelA);
      return `${s.state} ${s.transition ?? 'none'}`;
    }, { timeout: 30 * 1000 })
    .toBe('granted none');
  await expect(badge).toHaveText('granted');
  await expect(notebook.locator('.jp-Cell').nth(2).locator('.jp-InputPrompt')).toHaveText(/^\[\d+\]:$/, { timeout: 30 * 1000 });
  await screenshot(page, 'resume-ahead-04-resumed-by-work');
  clearInterval(watch);
  console.log(`REST state of A: ${history.join(' → ')}`);
});
