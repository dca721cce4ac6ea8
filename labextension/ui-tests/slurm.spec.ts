/**
 * Issue 13, "Must show": on the Slurm backend the sidebar and the status bar show each kernel's
 * Slurm job id, partition and queue position, with Slurm's pending reason in words. JupyterLab
 * runs with GPUPOOL_BACKEND=slurm against a real single-node Slurm cluster (16 GRES shards, two
 * stand-in GPUs) that `run.sh slurm` starts and stops; each kernel asks for 80 GiB, i.e. one GPU's
 * 8 shards. Two notebooks run as jobs, a third pends at position 1 (reason Resources), and shutting
 * one running kernel down starts the third. The job ids come from the REST API and are checked
 * against `squeue`. Screenshots of each step go to $GPUPOOL_UI_SCREENSHOTS.
 */
import { APIRequestContext, expect, Locator, Page, test } from '@playwright/test';
import { execFileSync } from 'child_process';

import { api, kernelOf, openLab, openNotebook, screenshot, TOKEN } from './helpers';

const SLURM_CONF = process.env.GPUPOOL_UI_SLURM_CONF ?? '';
/** Starting a kernel is an sbatch, a job start and an srun step: allow for a slow, shared host. */
const KERNEL_START_MS = 90 * 1000;

interface ISqueueJob {
  state: string;
  partition: string;
  reason: string;
}

/** Run `squeue` with these arguments against the suite's cluster; its stdout. */
function runSqueue(args: string[]): string {
  return execFileSync('squeue', ['-h', ...args], {
    env: { ...process.env, SLURM_CONF },
    encoding: 'utf-8',
    timeout: 30 * 1000
  });
}

/** `squeue` of the suite's cluster: job id → state, partition, reason. */
function squeue(): Map<string, ISqueueJob> {
  const out = runSqueue(['-o', '%i|%T|%P|%r']);
  const jobs = new Map<string, ISqueueJob>();
  for (const line of out.split('\n')) {
    const [id, state, partition, reason] = line.trim().split('|');
    if (id) {
      jobs.set(id, { state, partition, reason });
    }
  }
  return jobs;
}

/** Ids of the pending jobs in Slurm's priority order, as the backend counts positions. */
function pendingInSlurmOrder(): string[] {
  return runSqueue(['-t', 'PD', '--sort=-p,i', '-o', '%i'])
    .split('\n')
    .map(line => line.trim())
    .filter(line => line !== '');
}

/** The kernel's `slurm` object from `GET /api/gpupool/kernels/{id}`, once it has a job id. */
async function slurmJob(request: APIRequestContext, kernelId: string): Promise<any> {
  let job: any = null;
  await expect
    .poll(
      async () => {
        const reply = await api(request, `api/gpupool/kernels/${kernelId}`);
        job = reply.ok() ? (await reply.json()).slurm ?? null : null;
        return job?.job_id ?? '';
      },
      { message: `a Slurm job for kernel ${kernelId}`, timeout: KERNEL_START_MS }
    )
    .not.toBe('');
  return job;
}

/** Wait until `squeue` shows `jobId` in `state` (in partition gpu). */
async function expectJobState(jobId: string, state: string): Promise<void> {
  await expect
    .poll(() => squeue().get(jobId)?.state ?? 'not in squeue', {
      message: `squeue shows job ${jobId} ${state}`,
      timeout: KERNEL_START_MS
    })
    .toBe(state);
  expect(squeue().get(jobId)?.partition).toBe('gpu');
}

/** The status bar item's tooltip (its title attribute). */
async function expectStatusTitle(status: Locator, pattern: RegExp): Promise<void> {
  await expect(status).toHaveAttribute('title', pattern);
}

/** Open `notebook` and wait until its kernel runs as a Slurm job: status bar, sidebar and squeue agree. */
async function openRunning(
  page: Page,
  request: APIRequestContext,
  notebook: string
): Promise<{ kernelId: string; jobId: string }> {
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  await openNotebook(page, notebook);
  const kernelId = await kernelOf(request, notebook);
  const job = await slurmJob(request, kernelId);
  const jobId = String(job.job_id);
  await expectJobState(jobId, 'RUNNING');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 80 GiB/, { timeout: KERNEL_START_MS });
  await expect(panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge')).toHaveText('granted');
  await expect(panel.locator('.jp-GpuPool-summary')).toContainText('80 GiB granted on GPU');
  await expect(panel.locator('.jp-GpuPool-scheduler')).toHaveText(
    `Slurm job ${jobId} · partition gpu · node node0`
  );
  await expectStatusTitle(status, new RegExp(`Slurm job ${jobId} · partition gpu · node node0`));
  return { kernelId, jobId };
}

test('the sidebar and status bar show the Slurm job, partition, queue position and reason', async ({
  page,
  request
}) => {
  test.setTimeout(8 * 60 * 1000);
  expect(SLURM_CONF, 'GPUPOOL_UI_SLURM_CONF is set (run ui-tests/run.sh slurm)').not.toBe('');
  await openLab(page);
  const status = page.locator('.jp-GpuPool-status');
  const panel = page.locator('#jupyter-gpupool-panel');
  const leaseBadge = panel.locator('.jp-GpuPool-lease .jp-GpuPool-badge');
  const scheduler = panel.locator('.jp-GpuPool-scheduler');

  // The panel open in the right sidebar from the start.
  await page.locator('.jp-SideBar.jp-mod-right [title^="GPU pool"]').first().click();
  await expect(panel).toBeVisible();

  // 1. First notebook: its kernel runs as a Slurm job; the panel names the job, partition and node.
  const first = await openRunning(page, request, 'a.ipynb');
  await screenshot(page, 'slurm-01-first-running');

  // 2. Second notebook: a second job on the node's other 8 shards.
  const second = await openRunning(page, request, 'b.ipynb');
  expect(second.jobId).not.toBe(first.jobId);
  await screenshot(page, 'slurm-02-second-running');

  // 3. Third notebook: its job pends; the panel says position 1 and Slurm's reason in words.
  await openNotebook(page, 'c.ipynb');
  const third = await kernelOf(request, 'c.ipynb');
  const thirdJob = String((await slurmJob(request, third)).job_id);
  expect([first.jobId, second.jobId]).not.toContain(thirdJob);
  await expectJobState(thirdJob, 'PENDING');
  await expect(status).toHaveText('GPU queued #1');
  await expect(leaseBadge).toHaveText('queued');
  await expect(scheduler).toHaveText(`Slurm job ${thirdJob} · partition gpu · position 1 among pending jobs`);
  await expect(panel.locator('.jp-GpuPool-queueText')).toHaveText(/^waiting for a GPU — position 1 of 1, /);
  // Slurm's reason is "None" until its scheduler has looked at the job, then Resources.
  await expect(panel.locator('.jp-GpuPool-queue .jp-GpuPool-muted')).toHaveText(
    'the GPUs it needs are in use by other jobs; it starts when one of them ends (Slurm: Resources)',
    { timeout: 30 * 1000 }
  );
  await expect.poll(() => squeue().get(thirdJob)?.reason, { message: 'squeue says Resources' }).toBe('Resources');
  // Position 1 as Slurm orders its pending jobs (squeue -t PD --sort=-p,i): the only one, first.
  expect(pendingInSlurmOrder()).toEqual([thirdJob]);
  await expectStatusTitle(
    status,
    new RegExp(`Slurm job ${thirdJob} · partition gpu · position 1 among pending jobs`)
  );
  await screenshot(page, 'slurm-03-third-pending');

  // 4. Shut the first kernel down: its job is cancelled, the third job starts and the panel follows.
  const response = await request.delete(`api/kernels/${first.kernelId}`, {
    headers: { Authorization: `token ${TOKEN}` }
  });
  expect(response.status()).toBe(204);
  await expect.poll(() => squeue().has(first.jobId), { message: `job ${first.jobId} cancelled` }).toBe(false);
  await expectJobState(thirdJob, 'RUNNING');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 80 GiB/, { timeout: KERNEL_START_MS });
  await expect(leaseBadge).toHaveText('granted');
  await expect(scheduler).toHaveText(`Slurm job ${thirdJob} · partition gpu · node node0`);
  await expect(panel.locator('.jp-GpuPool-queueText')).toHaveCount(0);
  await expectStatusTitle(status, new RegExp(`Slurm job ${thirdJob} · partition gpu · node node0`));

  // The kernel really runs in that job: a cell prints its SLURM_JOB_ID.
  const editor = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell .jp-InputArea-editor').first();
  await editor.click();
  await page.keyboard.press('Control+A');
  await page.keyboard.type("import os; print('job', os.environ['SLURM_JOB_ID'])");
  await page.keyboard.press('Shift+Enter');
  await expect(page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output').first()).toHaveText(
    `job ${thirdJob}`,
    { timeout: KERNEL_START_MS }
  );
  await screenshot(page, 'slurm-04-third-running-after-shutdown');
});
