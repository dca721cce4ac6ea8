/**
 * State → view: turn the server's replies into what the sidebar and the status bar
 * show. Pure functions of their inputs (the server clock is passed in), tested with jest.
 */

import { clockTime, dateTimeRange } from './dates';
import { IDevice, IKernelStatus, IPoolLease, IPoolSnapshot, IQuota, IReservation, IUnpooledUse } from './types';
import {
  formatCountdown,
  formatDuration,
  formatGibHours,
  formatRemaining,
  formatSize,
  formatSizePair,
  formatWait,
  GIB,
  InvalidInput,
  parseDuration,
  parseSize,
  sizeArgument,
  sizeUnit
} from './units';
import { growWait, upcomingReclaim } from './wording';

/** Where the current kernel stands, as far as the front end knows. */
export type KernelPhase =
  | 'no-kernel' // no notebook or console with a kernel is current
  | 'loading' // a kernel, but no answer yet
  | 'no-lease' // the server knows no lease for this kernel (not a GPU kernel)
  | 'queued'
  | 'granted'
  | 'suspended'
  | 'released'
  | 'cpu-only' // the pool is unavailable: the kernel runs without a GPU
  | 'failed' // the kernel's start failed (the pool refused it, or was unavailable with "refuse")
  | 'unavailable'; // the server extension does not answer

/** A horizontal bar: a filled fraction, optional markers (e.g. the peak). */
export interface IBar {
  fraction: number;
  label: string;
  markers: Array<{ fraction: number; label: string }>;
  warn: boolean;
}

/** Everything the panel and the status bar show about one kernel. */
export interface IKernelView {
  phase: KernelPhase;
  /** Status-bar text; empty hides the item. */
  statusText: string;
  /** Status-bar tooltip and accessible name. */
  statusTitle: string;
  /** One line at the top of the panel. */
  summary: string;
  /** `GPU 0 · NVIDIA A100-SXM4-80GB`, null when not placed. */
  gpu: string | null;
  slice: IBar | null;
  usage: IBar | null;
  hint: { text: string; memory: string; button: string } | null;
  enforcement: { level: string; label: string; text: string } | null;
  queue: { text: string; reason: string } | null;
  /** Where an external scheduler runs the kernel ("Slurm job 12 · partition gpu · …"), or null. */
  scheduler: string | null;
  idle: {
    text: string;
    countdown: string;
    secondsLeft: number;
    reason: string;
    /** The kernel is suspended (variables kept) rather than shut down when the countdown ends. */
    suspends: boolean;
  } | null;
  /** A suspended kernel: `GPU suspended · 6.2 GiB parked — resumes on your next cell`, and why. */
  suspended: { text: string; reason: string } | null;
  /** A move of the GPU memory under way (`suspending — parking GPU memory in host RAM…`), or null. */
  transition: string | null;
  /**
   * An elastic slice: `4 GiB guaranteed · 9.2 GiB now, up to 40 GiB` (as `%gpupool status` words it),
   * and the pool's last grow or give-back step (or why it did not grow). Null for a fixed slice.
   */
  elastic: IElasticView | null;
  /**
   * `No burst: CUDA MPS set this kernel's memory limit when it started.` where the kernel's
   * enforcement fixed its size at start (MPS, HAMi-core; a Slurm job's shards), else null.
   */
  burstFixed: string | null;
  /** The panel's badge when the phase alone says too little (`resuming`, `suspending`), else null. */
  badge: string | null;
  kept: string | null;
  overLimit: string | null;
  released: string | null;
  canKeep: boolean;
  canRelease: boolean;
  canReserve: boolean;
  /** A Suspend button: granted, nothing under way, and its server can park GPU memory. */
  canSuspend: boolean;
  /** A Resume button: suspended. */
  canResume: boolean;
  /** Memory of the kernel's GPU, for `25%` in the reserve form. */
  gpuMemory: number | null;
}

/** What the sidebar shows of an elastic slice (see `IKernelView.elastic`). */
export interface IElasticView {
  /** `4 GiB guaranteed · 9.2 GiB now, up to 40 GiB` (all its GPUs). */
  line: string;
  /** The last step in the pool's words: `grown to 8 GiB on demand (...)`, `burst taken back for ...`. */
  step: string | null;
  /** The pool took its burst back and the kernel is giving it back now. */
  takenBack: boolean;
  /** While a grow waits for room: `waiting to grow to 12 GiB since 14:02 (2nd in line)`. */
  waiting: string | null;
}

/** What the view of a kernel is computed from. */
export interface IKernelInput {
  kernelId: string | null;
  /** The last reply for this kernel, or null. */
  status: IKernelStatus | null;
  /** The server answered 404: no lease for this kernel (now). */
  missing: boolean;
  /** A request error other than 404, one line. */
  error: string | null;
  /** A reason heard from an event for this kernel (e.g. a reclaim), if any. */
  eventReason?: string | null;
  /** Server time, epoch seconds. */
  now: number;
  /** The pool's state from the last snapshot, if any (an unavailable pool shows in the status bar). */
  pool?: Pick<IPoolSnapshot, 'state' | 'reason' | 'no_gpu' | 'when_unavailable'> | null;
  /** The locale dates and times are written in (a BCP 47 tag); the browser's when absent. */
  locale?: string;
}

/** How the sidebar names an enforcement level in a word or two: `Soft limit`, `No limit`. */
export function enforcementLabel(level: string): string {
  if (level === 'none') {
    return 'No limit';
  }
  if (['soft', 'strong', 'hard'].includes(level)) {
    return `${level[0].toUpperCase()}${level.slice(1)} limit`;
  }
  return 'Limit';
}

/** "No GPU pool" when the host simply has no GPU, else "GPU pool unavailable". */
export function unavailableTitle(pool: { no_gpu?: boolean } | null | undefined): string {
  return pool?.no_gpu ? 'No GPU pool' : 'GPU pool unavailable';
}

const EMPTY: Omit<IKernelView, 'phase' | 'summary'> = {
  statusText: '',
  statusTitle: '',
  gpu: null,
  slice: null,
  usage: null,
  hint: null,
  enforcement: null,
  queue: null,
  scheduler: null,
  idle: null,
  suspended: null,
  transition: null,
  elastic: null,
  burstFixed: null,
  badge: null,
  kept: null,
  overLimit: null,
  released: null,
  canKeep: false,
  canRelease: false,
  canReserve: false,
  canSuspend: false,
  canResume: false,
  gpuMemory: null
};

/** What each move of a kernel's GPU memory is called: the line in the panel, the status bar, the badge. */
const TRANSITIONS: { [step: string]: { text: string; status: string; badge: string } } = {
  suspending: {
    text: 'suspending — parking GPU memory in host RAM…',
    status: 'GPU suspending…',
    badge: 'suspending'
  },
  restoring: {
    text: 'resuming — restoring GPU memory…',
    status: 'GPU resuming…',
    badge: 'resuming'
  },
  migrating: { text: 'moving to another GPU…', status: 'GPU moving…', badge: 'moving' }
};

/**
 * `GPU suspended · 6.2 GiB parked` (without the size when the server did not say), and against
 * what the kernel used where its server knows: `GPU suspended · 6.2 GiB parked of 6.5 GiB used`.
 */
export function parkedText(status: IKernelStatus): string {
  const parked = num(status.parked_memory);
  if (parked === null || parked <= 0) {
    return 'GPU suspended';
  }
  const used = num(status.parking?.used_before);
  return `GPU suspended · ${formatSize(parked)} parked` + (used !== null && used > 0 ? ` of ${formatSize(used)} used` : '') + (status.parking?.path ? ` · parked by ${status.parking.path}` : '');
}

/** ` 0.3 GiB of framework cache was freed first, so only live memory was copied.` (empty when none). */
export function cacheFreedText(status: IKernelStatus): string {
  const freed = num(status.parking?.cache_freed);
  return freed !== null && freed > 0 ? ` ${formatSize(freed)} of framework cache was freed first, so only live memory was copied.` : '';
}

function clamp01(value: number): number {
  return !isFinite(value) ? 0 : Math.min(1, Math.max(0, value));
}

function num(value: unknown): number | null {
  return typeof value === 'number' && isFinite(value) ? value : null;
}

/**
 * A right-sizing suggestion when a kernel peaked far below its slice:
 * `peaked at 2.1 GiB of 8 — shrink to 3 GiB?`. Suggests the peak plus a quarter,
 * rounded up to whole GiB (at least 1 GiB), and only when that is at most half the slice.
 */
export function rightSizeHint(
  memory: number,
  peak: number | null | undefined
): { text: string; memory: string; button: string } | null {
  if (!peak || peak <= 0 || !memory || memory <= 0) {
    return null;
  }
  const suggested = Math.max(1, Math.ceil((peak * 1.25) / GIB)) * GIB;
  if (suggested > memory / 2 || memory - suggested < GIB) {
    return null;
  }
  const [unit] = sizeUnit(memory);
  const [peakUnit] = sizeUnit(peak);
  const sliceText =
    unit === peakUnit
      ? formatSize(memory).replace(` ${unit}`, '')
      : formatSize(memory);
  const target = formatSize(suggested);
  return {
    text: `peaked at ${formatSize(peak)} of ${sliceText} — shrink to ${target}?`,
    memory: sizeArgument(suggested),
    button: `Shrink to ${target}`
  };
}

/**
 * An elastic slice in one line, as `%gpupool status` says it (jupyter_gpupool/rest/views.py
 * `elastic_line`): `4 GiB guaranteed · 9.2 GiB now, up to 40 GiB`, all its GPUs together; an
 * empty string for a fixed slice (its limit is its guarantee) or a server without elastic slices.
 */
export function elasticLine(
  status: Pick<IKernelStatus, 'memory' | 'guarantee' | 'limit' | 'num_gpus'>
): string {
  const guarantee = num(status.guarantee);
  const limit = num(status.limit);
  const memory = num(status.memory) ?? 0;
  if (guarantee === null || limit === null || guarantee <= 0 || limit <= guarantee) {
    return '';
  }
  const gpus = Math.max(1, num(status.num_gpus) ?? 1);
  return (
    `${formatSize(guarantee * gpus)} guaranteed · ${formatSize(memory * gpus)} now, ` +
    `up to ${formatSize(Math.max(limit, memory) * gpus)}`
  );
}

/** `No burst: ...` where enforcement fixed the size at start (also for a fixed Slurm slice). */
function burstFixedText(status: IKernelStatus): string | null {
  const why = (status.burst_fixed ?? '').trim().replace(/[.;:]+$/, '');
  return why ? `No burst: ${why}.` : null;
}

/** What the sidebar shows of an elastic slice, or null for a fixed one. */
export function elasticView(status: IKernelStatus, locale?: string): IElasticView | null {
  const line = elasticLine(status);
  if (!line) {
    return null;
  }
  const since = num(status.grow_since);
  const wanted = num(status.grow_wanted);
  const gpus = Math.max(1, num(status.num_gpus) ?? 1);
  return {
    line,
    step: (status.burst_note ?? '').trim() || null,
    takenBack: num(status.burst_taken_at) !== null,
    waiting:
      since !== null && wanted !== null && wanted > 0
        ? growWait(wanted * gpus, clockTime(new Date(since * 1000), locale), num(status.grow_place))
        : null
  };
}

/** The Slurm job behind a lease, or the kernel gateway a kernel runs on, in one line; else null. */
export function schedulerLine(status: IKernelStatus): string | null {
  if (status.gateway) {
    return `on the kernel gateway at ${status.gateway}: the slice is its host's pool's (change it with %gpupool in the notebook)`;
  }
  const job = status.slurm;
  if (!job || !job.job_id) {
    return null;
  }
  const parts = [`Slurm job ${job.job_id}`];
  if (job.partition) {
    parts.push(`partition ${job.partition}`);
  }
  if (job.node) {
    parts.push(`node ${job.node}`);
  }
  const position = num(job.position);
  if (position !== null) {
    parts.push(`position ${position} among pending jobs`);
  }
  return parts.join(' · ');
}

/** The panel's and status bar's view of the current kernel. */
export function kernelView(input: IKernelInput): IKernelView {
  const view = kernelViewOf(input);
  const pool = input.pool;
  if (
    pool?.state === 'unavailable' &&
    ['no-kernel', 'no-lease', 'loading'].includes(view.phase)
  ) {
    // Nothing about this kernel says more: say the pool is unavailable, and why.
    const title = unavailableTitle(pool);
    const kernels =
      pool.when_unavailable === 'refuse'
        ? 'kernels are refused until it is back'
        : 'kernels run CPU-only';
    return {
      ...view,
      statusText: title,
      statusTitle: `${title}: ${pool.reason || 'no reason given'}; ${kernels}`
    };
  }
  const scheduler =
    input.status && view.phase !== 'no-kernel' && view.phase !== 'loading'
      ? schedulerLine(input.status)
      : null;
  if (!scheduler) {
    return view;
  }
  // The status bar's tooltip (and accessible name) names the job too, not only the panel.
  return {
    ...view,
    scheduler,
    statusTitle: view.statusTitle ? `${view.statusTitle}; ${scheduler}` : scheduler
  };
}

function kernelViewOf(input: IKernelInput): IKernelView {
  const { status } = input;
  if (!input.kernelId) {
    return {
      ...EMPTY,
      phase: 'no-kernel',
      summary: 'Open a notebook to see the GPU slice of its kernel.'
    };
  }
  if (!status || input.missing) {
    return withoutLeaseView(input);
  }
  const unusable = unusableView(status, input);
  if (unusable) {
    return unusable;
  }
  const memory = num(status.memory) ?? 0;
  const devices = status.devices ?? [];
  const gpuMemory =
    devices.length > 0
      ? Math.max(...devices.map(d => num(d.memory_total) ?? 0)) || null
      : null;
  if (status.state === 'queued') {
    return queuedView(status, memory, gpuMemory);
  }
  if (status.state === 'released') {
    const reason =
      status.release_reason || input.eventReason || 'no reason given';
    return {
      ...EMPTY,
      phase: 'released',
      statusText: 'GPU released',
      statusTitle: `GPU released: ${reason}`,
      summary: 'This kernel no longer holds a GPU slice.',
      released: reason,
      gpuMemory
    };
  }
  const step = status.transition ? TRANSITIONS[status.transition] ?? null : null;
  if (status.state === 'suspended' && !step) {
    return suspendedView(status, memory, gpuMemory);
  }
  // granted (possibly in the middle of a move of its memory)
  return grantedView(status, { memory, gpuMemory, step, now: input.now, locale: input.locale });
}

/** No reply for the kernel yet, a request error, or no lease (any more). */
function withoutLeaseView(input: IKernelInput): IKernelView {
  const { status } = input;
  if (input.error && !status) {
    return {
      ...EMPTY,
      phase: 'unavailable',
      statusText: 'GPU pool unavailable',
      statusTitle: `GPU pool unavailable: ${input.error}`,
      summary: `GPU pool unavailable: ${input.error}`
    };
  }
  if (input.missing && status && status.state !== 'released') {
    // We saw a lease, now the server has none: it went back to the pool.
    const reason = input.eventReason || 'its slice went back to the pool';
    return {
      ...EMPTY,
      phase: 'released',
      statusText: 'GPU released',
      statusTitle: `GPU released: ${reason}`,
      summary: 'This kernel no longer holds a GPU slice.',
      released: reason
    };
  }
  if (input.missing) {
    return {
      ...EMPTY,
      phase: 'no-lease',
      summary: 'This kernel holds no GPU slice.'
    };
  }
  return { ...EMPTY, phase: 'loading', summary: 'Asking the GPU pool…' };
}

/** A kernel that runs without a slice: CPU-only, failed to start, or holding none; else null. */
function unusableView(status: IKernelStatus, input: IKernelInput): IKernelView | null {
  if (status.state === 'unavailable') {
    const reason = status.reason || input.pool?.reason || 'no reason given';
    // The pool may be back since (the reason then says to restart): the kernel still runs CPU-only.
    const title = input.pool?.state === 'available' ? 'GPU: CPU only' : unavailableTitle(input.pool);
    return {
      ...EMPTY,
      phase: 'cpu-only',
      statusText: title,
      statusTitle: `${title}: ${reason}; this kernel runs CPU-only`,
      summary: `${title} (${reason}): this kernel runs CPU-only, without a GPU. Restart it once the pool is back to get a slice.`
    };
  }

  if (status.state === 'failed') {
    const reason = status.reason || 'no reason given';
    return {
      ...EMPTY,
      phase: 'failed',
      statusText: 'GPU start failed',
      statusTitle: `This kernel did not start: ${reason}`,
      summary: `This kernel did not start: ${reason}`
    };
  }

  if (status.state === 'none' || !['queued', 'granted', 'suspended', 'released'].includes(status.state)) {
    return {
      ...EMPTY,
      phase: 'no-lease',
      summary: status.gateway && status.reason ? `This kernel holds no GPU slice: ${status.reason}.` : 'This kernel holds no GPU slice.'
    };
  }
  return null;
}

/** A request waiting in the queue: a new one, a suspended kernel resuming, or one whose wait retries. */
function queuedView(status: IKernelStatus, memory: number, gpuMemory: number | null): IKernelView {
  const position = num(status.queue_position);
  const length = num(status.queue_length);
  const where =
    position !== null
      ? `position ${position}` + (length !== null ? ` of ${length}` : '')
      : 'in the queue';
  const wait = num(status.estimated_wait);
  const waitText = wait === null ? 'wait unknown' : formatWait(wait);
  const text = status.resuming
    ? `resuming — waiting for a GPU, ${where}, ${waitText}`
    : `waiting for a GPU — ${where}, ${waitText}`;
  const queued = {
    ...EMPTY,
    phase: 'queued' as const,
    queue: { text, reason: status.queue_reason ?? '' },
    canRelease: true,
    gpuMemory
  };
  // The server's wait cannot reach the pool (a broker restart): it keeps its place and retries.
  const retrying = /^pool unavailable\b/i.test(status.queue_reason ?? '');
  if (retrying) {
    return {
      ...queued,
      statusText: 'GPU pool unavailable, retrying',
      statusTitle: `${formatSize(memory)} requested, still in the queue (${where}); ${status.queue_reason}`,
      summary: `${formatSize(memory)} requested; the GPU pool cannot be reached now, the request keeps its place and is retried.`
    };
  }
  if (status.resuming) {
    // A suspended kernel coming back: queued like any request, its memory still parked.
    const parked = parkedText(status);
    return {
      ...queued,
      badge: 'resuming',
      statusText: position !== null ? `Resuming #${position}` : 'Resuming',
      statusTitle: `${parked}; ${text}`,
      summary: `${parked} — resumes when a GPU is free; a cell run now waits, then runs.`
    };
  }
  return {
    ...queued,
    statusText: position !== null ? `GPU queued #${position}` : 'GPU queued',
    statusTitle: `${formatSize(memory)} requested; ${text}`,
    summary: `${formatSize(memory)} requested; the kernel starts when a GPU is free.`,
    canReserve: true
  };
}

/** Parked in host RAM: no GPU, no use to measure; the next cell (or Resume) brings it back. */
function suspendedView(status: IKernelStatus, memory: number, gpuMemory: number | null): IKernelView {
  const text = `${parkedText(status)} — resumes on your next cell`;
  const reason = status.suspend_reason || '';
  return {
    ...EMPTY,
    phase: 'suspended',
    statusText: 'GPU suspended',
    statusTitle: text + (reason ? ` (${reason})` : ''),
    summary: `${formatSize(memory)} slice suspended: the kernel keeps its variables, its GPU memory waits in host RAM.${cacheFreedText(status)}`,
    suspended: { text, reason },
    canRelease: true,
    canResume: true,
    gpuMemory
  };
}

/** What a granted slice's view is computed from besides its status. */
interface IGrantedContext {
  memory: number;
  gpuMemory: number | null;
  /** A move of its memory under way, or null. */
  step: { text: string; status: string; badge: string } | null;
  now: number;
  locale?: string;
}

/** `GPU 0 · NVIDIA A100-SXM4-80GB` (`GPUs 0, 1 · …` for several), null when not placed. */
function gpuLine(devices: NonNullable<IKernelStatus['devices']>): string | null {
  if (devices.length === 0) {
    return null;
  }
  const name = devices[0].name ?? 'unknown GPU';
  return devices.length === 1
    ? `GPU ${devices[0].index ?? '?'} · ${name}`
    : `GPUs ${devices.map(d => d.index ?? '?').join(', ')} · ${name}`;
}

/** The slice as a share of its GPU's memory, or null when the GPU's size is unknown. */
function sliceBar(memory: number, gpuMemory: number | null, perGpu: string): IBar | null {
  if (!gpuMemory || gpuMemory <= 0) {
    return null;
  }
  return {
    fraction: clamp01(memory / gpuMemory),
    label: `slice ${formatSize(memory)}${perGpu} of ${formatSize(gpuMemory)} (${Math.round(
      (100 * memory) / gpuMemory
    )}%)`,
    markers: [],
    warn: false
  };
}

/** The memory used of the slice, with its peak as a marker; null for an empty slice. */
function usageBar(memory: number, used: number | null, peak: number | null, over: boolean): IBar | null {
  if (memory <= 0) {
    return null;
  }
  return {
    fraction: used === null ? 0 : clamp01(used / memory),
    label:
      (used === null
        ? 'use not measured yet'
        : `using ${formatSize(used)} of ${formatSize(memory)}`) +
      (peak !== null ? ` · peak ${formatSize(peak)}` : ''),
    markers:
      peak !== null
        ? [
            {
              fraction: clamp01(peak / memory),
              label: `peak ${formatSize(peak)}`
            }
          ]
        : [],
    warn: over
  };
}

/** How the kernel's memory is held to its slice, or null when the server did not say. */
function enforcementView(status: IKernelStatus): IKernelView['enforcement'] {
  if (!status.enforcement) {
    return null;
  }
  const level = status.enforcement.level ?? 'unknown';
  const text =
    status.enforcement.description ||
    (status.enforcement.mechanisms ?? []).join(', ') ||
    'no enforcement reported';
  const device = status.enforcement.device_access;
  return {
    level,
    label: enforcementLabel(level),
    text: device ? `${text}; device access: ${device}` : text
  };
}

/** The idle countdown of a running slice the pool will take back, or null. */
function idleView(status: IKernelStatus, now: number, moving: boolean): IKernelView['idle'] {
  const reclaimAt = num(status.reclaim_at);
  if (status.state !== 'granted' || moving || reclaimAt === null) {
    return null;
  }
  const idleSeconds = num(status.idle_seconds);
  const secondsLeft = Math.max(0, reclaimAt - now);
  const countdown = formatCountdown(secondsLeft);
  const suspends = !!status.suspendable;
  return {
    text:
      (idleSeconds ? `idle for ${formatDuration(idleSeconds)} — ` : '') +
      (suspends
        ? `the kernel will be suspended (variables kept) in ${countdown} unless you keep it`
        : `slice goes back to the pool in ${countdown} unless you keep it`),
    countdown,
    secondsLeft,
    reason: status.reclaim_reason
      ? upcomingReclaim(status.reclaim_reason)
      : 'others are waiting for a GPU',
    suspends
  };
}

/** `using 6 GiB, above the 4 GiB slice for 2m — …` while the kernel uses more than it may, else null. */
function overLimitText(
  used: number | null,
  allowed: number,
  memory: number,
  overSince: number | null,
  now: number
): string | null {
  const over = used !== null && allowed > 0 && used > allowed;
  if (!over && overSince === null) {
    return null;
  }
  return (
    `using ${formatSize(used)}, above the ${formatSize(allowed)} ` +
    (allowed > memory ? "slice's limit" : 'slice') +
    (overSince !== null ? ` for ${formatDuration(Math.max(0, now - overSince))}` : '') +
    ' — free memory or reserve more, or the kernel may be stopped'
  );
}

/** A granted slice: where it runs, how much it uses, its idle countdown and what may be done. */
function grantedView(status: IKernelStatus, context: IGrantedContext): IKernelView {
  const { memory, gpuMemory, step, now } = context;
  const devices = status.devices ?? [];
  const gpu = gpuLine(devices);
  const perGpu = devices.length > 1 ? ' on each' : '';
  const used = num(status.used_memory);
  const peak = num(status.peak_memory);
  const elastic = elasticView(status, context.locale);
  // What the watchdog allows: an elastic slice's limit, or its size once its burst was taken back.
  const allowed = elastic && !elastic.takenBack ? Math.max(num(status.limit) ?? memory, memory) : memory;
  const over = used !== null && allowed > 0 && used > allowed;
  const idle = idleView(status, now, !!step);
  const keepUntil = num(status.keep_until);
  const running = status.state === 'granted' && !step;
  return {
    ...EMPTY,
    phase: status.state === 'suspended' ? 'suspended' : 'granted',
    badge: step ? step.badge : null,
    statusText: step
      ? step.status
      : `GPU ${formatSizePair(used ?? (memory > 0 ? null : 0), memory)}` + (idle ? ` · ${idle.countdown}` : ''),
    statusTitle:
      (step ? `${step.text}; ` : '') +
      (elastic ? `${elastic.line}${gpu ? `; ${gpu}` : ''}` : `${formatSize(memory)}${perGpu}` + (gpu ? ` on ${gpu}` : '')) +
      (used !== null ? `, using ${formatSize(used)}` : '') +
      (idle ? `; ${idle.text}` : ''),
    summary: `${formatSize(memory)}${perGpu} granted` + (gpu ? ` on ${gpu}` : ''),
    transition: step ? step.text : null,
    elastic,
    burstFixed: burstFixedText(status),
    gpu,
    slice: sliceBar(memory, gpuMemory, perGpu),
    usage: usageBar(memory, used, peak, over),
    // An elastic slice is sized by its guarantee: what it holds above that goes back by itself.
    hint: running ? rightSizeHint(num(status.guarantee) || memory, peak) : null,
    enforcement: enforcementView(status),
    idle,
    kept:
      keepUntil !== null && keepUntil > now
        ? `kept through idle for another ${formatRemaining(keepUntil - now)}`
        : null,
    overLimit: overLimitText(used, allowed, memory, num(status.over_limit_since), now),
    canKeep: running,
    canRelease: true,
    canReserve: !step,
    canSuspend: running && !!status.suspendable,
    gpuMemory
  };
}

/** One lease on one GPU in the pool bars, or the memory used outside the pool (`outside`). */
export interface ISegment {
  key: string;
  fraction: number;
  mine: boolean;
  current: boolean;
  /** Memory held by processes without a granted lease, which the pool does not grant. */
  outside: boolean;
  label: string;
}

/** Memory used outside the pool on one GPU: how much, and whose where the viewer may see it. */
export interface IOutsideView {
  bytes: number;
  /** `outside the pool: 3 GiB`. */
  label: string;
  /**
   * One line per process the viewer may see (an admin: all; others: their own),
   * `pid 4242 · bob · python train.py — 3 GiB (no lease)`, then `2 GiB used outside the pool`
   * for the rest, whose owners are not shown.
   */
  lines: string[];
}

/** One GPU in the pool view. */
export interface IDeviceView {
  key: string;
  title: string;
  segments: ISegment[];
  /** Memory really in use on the GPU (all processes), as a fraction. */
  usedFraction: number | null;
  /** Memory used outside the pool on this GPU, or null when there is none. */
  outside: IOutsideView | null;
  text: string;
  ariaLabel: string;
  healthy: boolean;
}

/** One reservation as the sidebar lists it. */
export interface IReservationView {
  key: string;
  name: string;
  /** `cs101, bob` (groups and users it is for). */
  who: string;
  memory: string;
  /** `Tue 1 Dec, 09:00–11:00` in the user's locale and time zone, or `every Tue 09:00–11:00`. */
  window: string;
  active: boolean;
}

/** A reservation's window in words: one-off in local time, weekly as the server states it. */
export function reservationWindow(reservation: IReservation, locale?: string): string {
  const start = num(reservation.start);
  const end = num(reservation.end);
  if (start !== null && end !== null) {
    return dateTimeRange(new Date(start * 1000), new Date(end * 1000), locale);
  }
  const days = (reservation.weekdays ?? []).map(d => d.charAt(0).toUpperCase() + d.slice(1));
  if (days.length && reservation.daily_start && reservation.daily_end) {
    return `every ${days.join(', ')} ${reservation.daily_start}–${reservation.daily_end}`;
  }
  return 'no window';
}

/** The reservations, open ones first. */
export function reservationViews(
  reservations: IReservation[] | null | undefined,
  locale?: string
): IReservationView[] {
  return (reservations ?? [])
    .map((r, i) => ({
      key: `${r.name}-${i}`,
      name: r.name,
      who: [...(r.groups ?? []), ...(r.users ?? [])].join(', ') || 'no one',
      memory: formatSize(num(r.memory)),
      window: reservationWindow(r, locale),
      active: !!r.active
    }))
    .sort((a, b) => Number(b.active) - Number(a.active));
}

/** The pool view. */
export interface IPoolView {
  /** Set while the server cannot use the pool: what to say, and why. */
  unavailable: { title: string; reason: string; kernels: string } | null;
  devices: IDeviceView[];
  /** Some GPU has memory used outside the pool (the legend names its colour). */
  outside: boolean;
  queueText: string;
  quota: Array<{ label: string; value: string }>;
  /** Capacity held for users or groups, open ones first. */
  reservations: IReservationView[];
  user: string;
  admin: boolean;
  /** The largest GPU's memory (for `25%` and upper bounds in the form). */
  largestGpu: number | null;
}

function segmentLabel(lease: IPoolLease, admin: boolean): string {
  const size = formatSize(lease.memory);
  const state = lease.state === 'granted' ? '' : ` (${lease.state})`;
  if (lease.mine) {
    return `you: ${size}` + (lease.label ? ` — ${lease.label}` : '') + state;
  }
  if (admin && lease.owner) {
    return `${lease.owner}: ${size}` + state;
  }
  return `another user: ${size}` + state;
}

/** Characters of a process's command line shown in the sidebar. */
const COMMAND_CHARS = 40;

/** A process's command line, its program without the folder (`python3 train.py`), cut to COMMAND_CHARS. */
function shortCommand(command: string): string {
  const text = command.trim().replace(/^\S*\//, '');
  return text.length > COMMAND_CHARS ? `${text.slice(0, COMMAND_CHARS - 1)}…` : text;
}

/**
 * Memory used outside the pool on one GPU: the device's `memory_unpooled` (else the sum of its
 * `unpooled` items), the processes the server shows whose (an admin's view, the viewer's own),
 * and one line for the rest. Null when there is none.
 */
export function outsideView(
  deviceBytes: number | null | undefined,
  uses: IUnpooledUse[]
): IOutsideView | null {
  const sized = uses.map(use => ({ use, bytes: Math.max(0, num(use.bytes) ?? 0) }));
  const listed = sized.reduce((sum, item) => sum + item.bytes, 0);
  const bytes = Math.max(0, num(deviceBytes) ?? listed);
  if (bytes <= 0) {
    return null;
  }
  const lines: string[] = [];
  let hidden = 0;
  for (const { use, bytes: held } of [...sized].sort((a, b) => b.bytes - a.bytes)) {
    const pid = num(use.pid);
    if (pid === null) {
      hidden += held;
      continue;
    }
    const parts = [`pid ${pid}`];
    if (use.user) {
      parts.push(use.mine ? `${use.user} (you)` : use.user);
    }
    if (use.command) {
      parts.push(shortCommand(use.command));
    }
    lines.push(`${parts.join(' · ')} — ${formatSize(held)}` + (use.why ? ` (${use.why})` : ''));
  }
  // What the items do not account for (another host's share, an older server) counts as hidden.
  hidden += Math.max(0, bytes - listed);
  if (hidden > 0) {
    lines.push(`${formatSize(hidden)} used outside the pool`);
  }
  return { bytes, label: `outside the pool: ${formatSize(bytes)}`, lines };
}

const QUOTA_LABELS: { [key: string]: string } = {
  maximum: 'Most you can hold',
  guaranteed: 'Guaranteed to you',
  held: 'Holding now',
  leases: 'Leases now',
  max_leases: 'Leases at most',
  gib_hours_this_month: 'Used this month',
  max_memory: 'Most you can hold',
  memory_limit: 'Most you can hold',
  gib_hours_used: 'Used',
  gib_hours_limit: 'Budget',
  max_duration: 'Longest lease'
};

/** Quota fields in bytes; the others are recognised by name. */
const BYTE_KEYS = new Set(['maximum', 'guaranteed', 'held', 'max_memory', 'memory_limit']);

/** Quota fields whose null means "no limit" (others are left out when null). */
const LIMIT_KEYS = new Set(['maximum', 'max_leases', 'max_memory', 'memory_limit', 'gib_hours_limit']);

function humanize(key: string): string {
  const text = key.replace(/_/g, ' ');
  return text.charAt(0).toUpperCase() + text.slice(1);
}

/** Quota lines from whatever fields the server sends, known ones worded well. */
export function quotaLines(
  quota: IQuota | null | undefined
): Array<{ label: string; value: string }> {
  if (!quota || typeof quota !== 'object') {
    return [];
  }
  const lines: Array<{ label: string; value: string }> = [];
  for (const [key, value] of Object.entries(quota)) {
    const label = QUOTA_LABELS[key] ?? humanize(key);
    if (value === null || value === undefined) {
      if (LIMIT_KEYS.has(key)) {
        lines.push({ label, value: 'no limit' });
      }
      continue;
    }
    if (typeof value === 'object') {
      continue;
    }
    let text: string;
    if (typeof value === 'number') {
      if (BYTE_KEYS.has(key)) {
        text = key === 'guaranteed' && value === 0 ? 'none' : formatSize(value);
      } else if (/gib_hours/.test(key)) {
        text = formatGibHours(value);
      } else if (/memory|bytes/.test(key)) {
        text = formatSize(value);
      } else if (/seconds|duration/.test(key)) {
        text = formatDuration(value);
      } else {
        text = String(value);
      }
    } else {
      text = String(value);
    }
    lines.push({ label, value: text });
  }
  return lines;
}

/** The pool view: one bar per GPU with leases stacked, the queue, the quota. */
export function poolView(
  snapshot: IPoolSnapshot | null,
  currentKernelId: string | null,
  locale?: string
): IPoolView | null {
  if (!snapshot) {
    return null;
  }
  const viewer = snapshot.viewer ?? snapshot.user ?? null;
  const admin = !!viewer?.admin;
  const leases = (snapshot.leases ?? []).filter(
    l => l.state === 'granted' || l.state === 'suspended'
  );
  const devices = (snapshot.devices ?? []).map(device =>
    deviceView(device, {
      leases: leases.filter(l => (l.devices ?? []).includes(device.uuid)),
      unpooled: (snapshot.unpooled ?? []).filter(use => use.device === device.uuid),
      admin,
      currentKernelId
    })
  );
  return {
    unavailable: poolUnavailableView(snapshot),
    devices,
    outside: devices.some(d => d.outside !== null),
    queueText: queueText(snapshot.queue ?? []),
    quota: quotaLines(snapshot.quota),
    reservations: reservationViews(snapshot.reservations, locale),
    user: viewer?.name ?? '',
    admin,
    largestGpu: largestGpu(snapshot.devices ?? [])
  };
}

/** What one GPU's view is computed from besides the device. */
interface IDeviceContext {
  /** The granted and suspended leases on this GPU. */
  leases: IPoolLease[];
  /** The memory used outside the pool on this GPU. */
  unpooled: IUnpooledUse[];
  admin: boolean;
  currentKernelId: string | null;
}

/** One GPU: its leases stacked (the user's first), the memory used outside the pool, its text. */
function deviceView(device: IDevice, context: IDeviceContext): IDeviceView {
  const total = num(device.memory_total) ?? 0;
  const outside = outsideView(device.memory_unpooled, context.unpooled);
  const segments = deviceSegments(device.uuid, total, outside, context);
  const leased =
    num(device.memory_leased) ?? context.leases.reduce((s, l) => s + l.memory, 0);
  const used = num(device.memory_used);
  const free = Math.max(0, total - leased - (outside?.bytes ?? 0));
  const text =
    `${formatSize(leased)} of ${formatSize(total)} leased, ` +
    (outside ? `${formatSize(outside.bytes)} used outside the pool, ` : '') +
    `${formatSize(free)} free` +
    (used !== null ? ` · ${formatSize(used)} in use` : '');
  const healthy = device.healthy !== false;
  return {
    key: device.uuid,
    title: `GPU ${device.index ?? '?'} · ${device.name ?? 'unknown GPU'}`,
    segments,
    usedFraction: used !== null && total > 0 ? clamp01(used / total) : null,
    outside,
    text: healthy ? text : `unhealthy: ${device.health_reason || 'unavailable'}`,
    ariaLabel:
      `GPU ${device.index ?? '?'}, ${device.name ?? 'unknown GPU'}: ${text}; ` +
      (segments.length
        ? segments.map(s => s.label).join('; ')
        : 'no leases'),
    healthy
  };
}

/** The bar's segments of one GPU: the leases, the user's own first, then the memory used outside. */
function deviceSegments(
  uuid: string,
  total: number,
  outside: IOutsideView | null,
  context: IDeviceContext
): ISegment[] {
  const { admin, currentKernelId } = context;
  // The user's own leases first, then the others, so "mine" reads at the left.
  const onDevice = [...context.leases].sort((a, b) => Number(!!b.mine) - Number(!!a.mine));
  const segments: ISegment[] = onDevice.map((lease, i) => ({
    key: `${lease.id ?? 'anonymous'}-${i}@${uuid}`,
    fraction: total > 0 ? clamp01(lease.memory / total) : 0,
    mine: !!lease.mine,
    current:
      !!currentKernelId && !!lease.mine && lease.kernel_id === currentKernelId,
    outside: false,
    label: segmentLabel(lease, admin)
  }));
  if (outside) {
    // After the leases, in what is left of the bar: slices are promised even where
    // memory used outside the pool makes them too big to fit (the text says how much).
    const leasedFraction = segments.reduce((sum, s) => sum + s.fraction, 0);
    segments.push({
      key: `outside@${uuid}`,
      fraction: total > 0 ? Math.min(clamp01(outside.bytes / total), Math.max(0, 1 - leasedFraction)) : 0,
      mine: false,
      current: false,
      outside: true,
      label: outside.label
    });
  }
  return segments;
}

/** `no one waiting`, `3 waiting (1 yours)`. */
function queueText(queue: NonNullable<IPoolSnapshot['queue']>): string {
  const mineQueued = queue.filter(q => (q as { mine?: boolean }).mine).length;
  return queue.length === 0
    ? 'no one waiting'
    : `${queue.length} waiting` + (mineQueued ? ` (${mineQueued} yours)` : '');
}

/** The largest GPU's memory, or null when no GPU says. */
function largestGpu(devices: IDevice[]): number | null {
  return devices.reduce<number | null>((max, d) => {
    const total = num(d.memory_total);
    return total !== null && (max === null || total > max) ? total : max;
  }, null);
}

/** What to say while the server cannot use the pool, or null when it can. */
function poolUnavailableView(snapshot: IPoolSnapshot): IPoolView['unavailable'] {
  if (snapshot.state !== 'unavailable') {
    return null;
  }
  return {
    title: unavailableTitle(snapshot),
    reason: snapshot.reason || 'no reason given',
    kernels:
      snapshot.when_unavailable === 'refuse'
        ? 'New kernels are refused until the pool is back.'
        : 'Kernels run CPU-only (no GPU) until the pool is back; restart a kernel then to get a slice.'
  };
}

/** The reserve form, checked before anything is sent. */
export interface IReserveCheck {
  ok: boolean;
  /** The body to POST, when ok. */
  body: { memory?: string; duration?: string };
  sizeError: string | null;
  durationError: string | null;
  /** Neither field filled in. */
  formError: string | null;
}

/**
 * Check the reserve form with the same forms the server accepts. Either field may be
 * empty (resize only, or hold through idle only), not both. A size above the largest
 * GPU is refused here too, saying the most one may ask for.
 */
export function checkReserve(
  size: string,
  duration: string,
  gpuMemory: number | null,
  largestGpu: number | null
): IReserveCheck {
  const result: IReserveCheck = {
    ok: false,
    body: {},
    sizeError: null,
    durationError: null,
    formError: null
  };
  const sizeText = size.trim();
  const durationText = duration.trim();
  if (!sizeText && !durationText) {
    result.formError = 'enter a size, a duration, or both';
    return result;
  }
  if (sizeText) {
    try {
      const bytes = parseSize(sizeText, gpuMemory ?? largestGpu);
      const limit = gpuMemory ?? largestGpu;
      if (limit !== null && bytes > limit) {
        result.sizeError = `requested ${formatSize(bytes)} but the largest GPU has ${formatSize(
          limit
        )}; ask for at most ${formatSize(limit)}`;
      } else {
        result.body.memory = sizeText.replace(/\s+/g, '');
      }
    } catch (error) {
      result.sizeError =
        error instanceof InvalidInput ? error.message : String(error);
    }
  }
  if (durationText) {
    try {
      parseDuration(durationText);
      result.body.duration = durationText.replace(/\s+/g, '');
    } catch (error) {
      result.durationError =
        error instanceof InvalidInput ? error.message : String(error);
    }
  }
  result.ok = !result.sizeError && !result.durationError;
  if (!result.ok) {
    result.body = {};
  }
  return result;
}
