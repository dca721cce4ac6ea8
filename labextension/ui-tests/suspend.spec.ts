/**
 * Issue 12, "Must show" (browser step): on a simulated 1x16GiB pool with 8 GiB slices, kernel A
 * is suspended (not shut down): the sidebar says how much is parked, that the next cell resumes
 * it and why, and the status bar says "GPU suspended"; B and C then hold the GPU; Resume queues A
 * ("resuming — waiting for a GPU, position 1 of 1"); when B stops, A is granted again. The REST
 * state of A goes granted → suspended → queued (resuming, position 1) → granted.
 *
 * Run by `ui-tests/run.sh suspend` (GPUPOOL_RECLAIM_ACTION=suspend, GPUPOOL_PARKED_MEMORY_LIMIT=32GiB).
 *
 * The server's part of a suspend (checkpoint the kernel, confirm) and its suspend/resume
 * endpoints were built in parallel with this front end. Where the server does not carry a step
 * out (a kernel it cannot suspend, a suspend or restore it does not finish within 5 s), the test
 * plays the server's part on the pool file (ui-tests/pool_steps.py) and says so in its output
 * ("PLAYED BY THE TEST"). Without a resume endpoint the Resume click shows the server's one-line
 * error in the panel and the resume is played too; with it, the click is what resumes the
 * kernel, and the test checks that through REST.
 */
import { APIRequestContext, expect, test } from '@playwright/test';
import { execFileSync } from 'child_process';
import * as path from 'path';

import { api, kernelOf, openLab, openNotebook, screenshot, TOKEN } from './helpers';

const GIB = 1024 ** 3;
const REASON = 'reclaimed: idle for 31 min while a request waited for a GPU';

/** Run a step of ui-tests/pool_steps.py on the server's pool file, with the server's policy. */
function poolStep(...args: string[]): any {
  const db = process.env.GPUPOOL_UI_DB ?? '';
  expect(db, 'GPUPOOL_UI_DB is set (run ui-tests/run.sh suspend)').not.toBe('');
  const out = execFileSync(
    process.env.GPUPOOL_UI_PYTHON || 'python',
    [path.join(__dirname, 'pool_steps.py'), ...args],
    {
      env: {
        ...process.env,
        PYTHONPATH: process.env.GPUPOOL_UI_REPO || path.resolve(__dirname, '..', '..'),
        GPUPOOL_DB: db,
        // The same pool and policy as run.sh gives this suite's server.
        GPUPOOL_SIMULATE: process.env.GPUPOOL_SIMULATE || '1x16GiB',
        GPUPOOL_DEFAULT_MEMORY: process.env.GPUPOOL_DEFAULT_MEMORY || '8GiB',
        GPUPOOL_RECLAIM_ACTION: 'suspend',
        GPUPOOL_PARKED_MEMORY_LIMIT: '32GiB'
      }
    }
  );
  const lease = JSON.parse(out.toString().trim().split('\n').pop()!);
  console.log(`PLAYED BY THE TEST (pool_steps.py ${args[0]}): ${JSON.stringify(lease)}`);
  return lease;
}

/** `GET /api/gpupool/kernels/{id}`. */
async function kernelStatus(request: APIRequestContext, kernelId: string): Promise<any> {
  return (await api(request, `api/gpupool/kernels/${kernelId}`)).json();
}

/**
 * Whether the server finishes the kernel's move of GPU memory (suspend, restore) within `ms`;
 * where it does not (no checkpoint backend on this server yet), the test plays its part.
 */
async function serverFinishes(request: APIRequestContext, kernelId: string, ms = 5000): Promise<boolean> {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    if (!(await kernelStatus(request, kernelId)).transition) {
      return true;
    }
    await new Promise(resolve => setTimeout(resolve, 250));
  }
  return false;
}

/** Whether the server routes `POST .../{action}` (asked on a running kernel, where it is harmless or refused). */
async function hasEndpoint(request: APIRequestContext, kernelId: string, action: string): Promise<boolean> {
  const answer = await request.post(`api/gpupool/kernels/${kernelId}/${action}`, {
    headers: { Authorization: `token ${TOKEN}` },
    data: {}
  });
  return answer.status() !== 404 && answer.status() !== 405;
}

test('a suspended kernel shows in the sidebar, and its Resume button brings it back', async ({ page, request }) => {
  // This test shows the Resume button, so the resume ahead of a cell (a suspended kernel's
  // notebook that gets focus resumes at once) is off here; resume-ahead.spec.ts shows it.
  const off = await request.put('lab/api/settings/jupyter-gpupool:plugin', {
    headers: { Authorization: `token ${TOKEN}` },
    data: { raw: '{"resumeAhead": false}' }
  });
  expect(off.status(), await off.text()).toBe(204);
  await openLab(page);
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const badge = panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge');
  const message = panel.locator('.jp-GpuPool-message');
  const showTab = (notebook: string) =>
    page.locator('#jp-main-dock-panel .lm-TabBar-tab', { hasText: notebook }).click();
  const history: string[] = [];
  const record = (s: any) => {
    const state = s.state === 'queued' && s.resuming ? `queued (resuming, position ${s.queue_position})` : s.state;
    if (history[history.length - 1] !== state) {
      history.push(state);
    }
  };

  // A and B hold the whole 16 GiB GPU.
  await openNotebook(page, 'a.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  await expect(panel).toBeVisible();
  const kernelA = await kernelOf(request, 'a.ipynb');
  record(await kernelStatus(request, kernelA));
  await openNotebook(page, 'b.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  const kernelB = await kernelOf(request, 'b.ipynb');
  await showTab('a.ipynb');
  await expect(badge).toHaveText('granted');

  // Resume is harmless on a running kernel: its answer says whether the server has the endpoint.
  const serverResumes = await hasEndpoint(request, kernelA, 'resume');
  console.log(
    serverResumes
      ? 'POST /api/gpupool/kernels/{id}/resume is served: the Resume click resumes the kernel'
      : 'NOTE: this server has no POST /api/gpupool/kernels/{id}/resume yet: the click shows its error, the resume is PLAYED BY THE TEST'
  );

  // 1. A is suspended: by the Suspend button where the server serves the endpoint (the button
  //    shows for a `suspendable` kernel; a server that cannot checkpoint yet has its lease marked
  //    so on the pool file), else through the pool file. Where the server does not carry the
  //    suspend out, the panel shows the step in between and the test confirms it.
  const suspendButton = panel.getByRole('button', { name: 'Suspend', exact: true });
  const byButton = serverResumes;
  let played = false;
  if (byButton) {
    if (!(await kernelStatus(request, kernelA)).suspendable) {
      console.log('NOTE: the server did not ask for a suspendable lease (it cannot checkpoint): marked so, PLAYED BY THE TEST');
      poolStep('mark-suspendable', kernelA);
    }
    await suspendButton.click();
    await expect(message).toHaveText('Suspending: the GPU memory goes to host RAM; the next cell brings it back.');
  } else {
    await expect(suspendButton).toHaveCount(0); // not suspendable: no button
    console.log('NOTE: this server has no suspend endpoint: the suspend is PLAYED BY THE TEST');
    poolStep('begin-suspend', kernelA, REASON);
  }
  if (!(await serverFinishes(request, kernelA))) {
    await expect(panel.locator('.jp-GpuPool-transitionText')).toHaveText(
      'suspending — parking GPU memory in host RAM…'
    );
    await expect(status).toHaveText('GPU suspending…');
    await expect(badge).toHaveText('suspending');
    await screenshot(page, 'suspend-01-suspending');
    console.log('NOTE: the server did not finish the suspend: its confirmation is PLAYED BY THE TEST');
    poolStep('confirm', kernelA, String(Math.round(6.2 * GIB)));
    played = true;
  }
  await expect(status).toHaveText('GPU suspended');
  await expect(badge).toHaveText('suspended');
  await expect(panel.locator('.jp-GpuPool-suspendedText')).toHaveText(
    played
      ? 'GPU suspended · 6.2 GiB parked — resumes on your next cell'
      : /^GPU suspended( · [\d.]+ [KMGT]?i?B parked)? — resumes on your next cell$/
  );
  await expect(panel.locator('.jp-GpuPool-suspendReason')).toHaveText(byButton ? /^suspended by / : REASON);
  await expect(panel.locator('.jp-GpuPool-meterRow')).toHaveCount(0); // no GPU bars while parked
  const suspended = await kernelStatus(request, kernelA);
  expect(suspended.state).toBe('suspended');
  expect(suspended.parked_memory).toBeGreaterThanOrEqual(played ? 1 : 0); // the server parks what the kernel used: nothing here
  record(suspended);
  await screenshot(page, 'suspend-02-suspended');

  // 2. A's GPU memory is free: C is granted in its place, so the GPU is full again.
  await openNotebook(page, 'c.ipynb');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await showTab('a.ipynb');
  await expect(badge).toHaveText('suspended');

  // 3. Resume: A queues for a GPU, at position 1, and the panel says it is resuming.
  const resume = panel.getByRole('button', { name: 'Resume', exact: true });
  await expect(resume).toBeVisible();
  await resume.click();
  if (serverResumes) {
    await expect(message).toHaveText('Resuming: the kernel waits for a GPU, then its memory is restored.');
  } else {
    // No endpoint on this server: the failure is one line in the panel, and nothing changes.
    await expect(message).toHaveText(/^Resume failed: /);
    expect((await kernelStatus(request, kernelA)).state).toBe('suspended');
    await screenshot(page, 'suspend-03-resume-not-served');
    poolStep('resume', kernelA);
  }
  await expect
    .poll(async () => {
      const s = await kernelStatus(request, kernelA);
      return `${s.state} ${s.resuming} ${s.queue_position}`;
    })
    .toBe('queued true 1');
  record(await kernelStatus(request, kernelA));
  await expect(status).toHaveText('Resuming #1');
  await expect(badge).toHaveText('resuming');
  await expect(panel.locator('.jp-GpuPool-queueText')).toHaveText(
    /^resuming — waiting for a GPU, position 1 of 1, /
  );
  await screenshot(page, 'suspend-04-resuming-queued');

  // 4. B stops: A is granted again (its memory restored by the server, or by the test's stand-in).
  const stopped = await request.delete(`api/kernels/${kernelB}`, { headers: { Authorization: `token ${TOKEN}` } });
  expect(stopped.status()).toBe(204);
  await expect
    .poll(async () => (await kernelStatus(request, kernelA)).state, { timeout: 20 * 1000 })
    .toBe('granted');
  if (!(await serverFinishes(request, kernelA))) {
    expect((await kernelStatus(request, kernelA)).transition).toBe('restoring');
    await expect(panel.locator('.jp-GpuPool-transitionText')).toHaveText('resuming — restoring GPU memory…');
    await expect(status).toHaveText('GPU resuming…');
    await screenshot(page, 'suspend-05-restoring');
    console.log('NOTE: the server did not restore the kernel: the restore is PLAYED BY THE TEST');
    poolStep('confirm', kernelA);
  }
  await expect
    .poll(async () => (await kernelStatus(request, kernelA)).transition, { timeout: 20 * 1000 })
    .toBeNull();
  record(await kernelStatus(request, kernelA));
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB$/);
  await expect(badge).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-suspended')).toHaveCount(0);
  await screenshot(page, 'suspend-06-granted-again');

  console.log(`REST state of A: ${history.join(' → ')}`);
  expect(history).toEqual(['granted', 'suspended', 'queued (resuming, position 1)', 'granted']);
});
