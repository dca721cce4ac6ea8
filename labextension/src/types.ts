/**
 * The REST API of the jupyter_gpupool server extension, typed as the front end reads it.
 *
 * Every field the server may leave out is optional here, and readers go through the
 * view-model functions (view.ts), which tolerate missing or null values. No JupyterLab
 * imports: this module is shared by the pure, jest-tested code.
 */

/** The jupyter_events schema id of the server's lease events. */
export const LEASE_EVENT_SCHEMA =
  'https://events.jupyter.org/jupyter_gpupool/lease/v2';

/**
 * The lease event's action when the watchdog first sees GPU memory held outside the pool: it has
 * no lease (`lease_id` and `state` are null) and never says whose; the pool view is read again.
 */
export const UNPOOLED_ACTION = 'unpooled';

/** Any event schema of jupyter_gpupool (lease, usage, ... versions to come). */
export const EVENT_SCHEMA_PREFIX = 'https://events.jupyter.org/jupyter_gpupool/';

export type LeaseState = 'queued' | 'granted' | 'suspended' | 'released';

/**
 * A kernel's state in `GET /api/gpupool/kernels/{id}`: `none` when it holds no lease,
 * `unavailable` when it runs CPU-only because the pool could not be used, `failed` when its
 * start failed (no kernel process); the last two come with a `reason`.
 */
export type KernelLeaseState = LeaseState | 'none' | 'unavailable' | 'failed';

/** The pool's own state in `GET /api/gpupool/pool`. */
export type PoolState = 'available' | 'unavailable';

/** A GPU as `GET /api/gpupool/pool` lists it. */
export interface IDevice {
  index: number | null;
  uuid: string;
  name: string | null;
  memory_total: number | null;
  memory_leased?: number;
  memory_used?: number | null;
  /** Bytes held by processes outside any granted lease (absent from older servers). */
  memory_unpooled?: number | null;
  healthy?: boolean;
  health_reason?: string;
}

/** A lease in the pool view: the viewer's own in full, others' anonymous unless admin. */
export interface IPoolLease {
  /** Null for other users' leases unless the viewer is an admin. */
  id: string | null;
  owner?: string | null;
  kernel_id?: string | null;
  memory: number;
  devices?: string[];
  state: LeaseState;
  mine?: boolean;
  label?: string;
  used_memory?: number | null;
  num_gpus?: number;
  priority?: string;
}

/** The viewer's quota and use; every field optional (the server decides which it has). */
export interface IQuota {
  [key: string]: unknown;
  /** Bytes always available to the user (null: none). */
  guaranteed?: number | null;
  /** Most bytes the user may hold at once (null: no limit). */
  maximum?: number | null;
  max_leases?: number | null;
  /** Bytes held now and number of live leases. */
  held?: number | null;
  leases?: number | null;
  gib_hours_this_month?: number | null;
}

/** A reservation in `GET /api/gpupool/pool`: capacity held for users or groups during a window. */
export interface IReservation {
  name: string;
  memory: number;
  users?: string[];
  groups?: string[];
  /** One-off window, epoch seconds. */
  start?: number | null;
  end?: number | null;
  /** Weekly window: days (`tue`) and HH:MM in the pool host's local time. */
  weekdays?: string[];
  daily_start?: string;
  daily_end?: string;
  /** Whether the window is open now. */
  active?: boolean;
}

/**
 * GPU memory one process holds on one GPU outside any granted lease (unpooled use): a kernel
 * started without the pool, a terminal's python, a kernel whose lease is suspended. Whose it is
 * (`pid`, `user`, `command`, `host`, `lease_id`) is null unless the viewer is an admin or it is
 * the viewer's own process (`mine`).
 */
export interface IUnpooledUse {
  /** Uuid of the GPU. */
  device: string;
  bytes: number;
  /** One clause: `no lease`, `its lease is suspended`, ... */
  why: string;
  /** When it was first seen (epoch seconds). */
  since?: number | null;
  pid?: number | null;
  user?: string | null;
  command?: string | null;
  host?: string | null;
  lease_id?: string | null;
  /** The host's watcher may signal it. */
  stoppable?: boolean;
  mine?: boolean;
}

/** `GET /api/gpupool/pool`. */
export interface IPoolSnapshot {
  devices: IDevice[];
  leases: IPoolLease[];
  queue: Array<{ [key: string]: unknown }>;
  quota?: IQuota;
  /** The pool's reservations (absent from older servers). */
  reservations?: IReservation[];
  /** GPU memory held outside the pool, one item per (host, GPU, process); absent from older servers. */
  unpooled?: IUnpooledUse[];
  /** Who is looking (the server sends `viewer`; `user` is accepted too). */
  viewer?: { name: string; admin: boolean };
  user?: { name: string; admin: boolean };
  /** Server time (epoch seconds) when the snapshot was taken. */
  now?: number;
  /** `unavailable` (with `reason`) while the server cannot use the pool; absent from older servers. */
  state?: PoolState;
  reason?: string | null;
  /** True when the cause is simply that the host has no NVIDIA GPU and no simulated pool. */
  no_gpu?: boolean;
  /** What kernel starts do meanwhile: run CPU-only, or be refused. */
  when_unavailable?: 'cpu-only' | 'refuse';
  unavailable_since?: number | null;
}

/** What enforces a slice and how strongly. */
export interface IEnforcement {
  level?: string;
  mechanisms?: string[];
  description?: string;
  /** Where the broker runs device control, while the kernel holds its GPUs: "this kernel's GPU only". */
  device_access?: string | null;
}

/** `GET /api/gpupool/kernels/{kernel_id}`. */
export interface IKernelStatus {
  lease_id: string | null;
  state: KernelLeaseState;
  memory: number;
  devices?: Array<Pick<IDevice, 'index' | 'uuid' | 'name' | 'memory_total'>>;
  queue_position?: number | null;
  queue_length?: number | null;
  estimated_wait?: number | null;
  /** Why it waits ("pool full", "over your quota"): optional. */
  queue_reason?: string | null;
  used_memory?: number | null;
  peak_memory?: number | null;
  enforcement?: IEnforcement | null;
  idle_seconds?: number | null;
  reclaim_at?: number | null;
  /** Why a reclaim is coming (idle while others wait, preemption): optional. */
  reclaim_reason?: string | null;
  release_reason?: string | null;
  keep_until?: number | null;
  /** Watchdog: usage above the slice since (epoch s): optional. */
  over_limit_since?: number | null;
  /** Server time (epoch seconds) of the answer: optional, the Date header otherwise. */
  now?: number | null;
  /** Why the kernel is `unavailable` (runs CPU-only) or `failed` (did not start). */
  reason?: string | null;
  /** The Slurm backend's job behind the lease (docs/hpc.md): optional. */
  slurm?: ISlurmJob | null;
  /** The kernel gateway the kernel runs on (its host's pool holds the slice; the kernel reported it): optional. */
  gateway?: string | null;
  /** A move of the kernel's GPU memory under way (null: none); absent from older servers. */
  transition?: Transition | null;
  /** Its server can park its GPU memory in host RAM: a reclaim suspends it instead of shutting it down. */
  suspendable?: boolean;
  /** Queued to come back after a suspend (`state` is then `queued`, with its position). */
  resuming?: boolean;
  /** Why it was suspended, e.g. `reclaimed: idle for 31 min while 2 requests waited for a GPU`. */
  suspend_reason?: string | null;
  /** When it was suspended (epoch s). */
  suspended_at?: number | null;
  /** Bytes of host RAM its parked GPU memory takes while suspended (or resuming). */
  parked_memory?: number | null;
  /** While suspended or resuming: what its server found when it parked it (null where it did not). */
  parking?: IParking | null;
  /** Uuids of the GPUs it ran on before the suspend. */
  home_devices?: string[];
  /** Elastic slices, bytes per GPU (absent from older servers): never taken back for anyone's request. */
  guarantee?: number | null;
  /** How far the slice may grow while its GPU has room; `guarantee` for a fixed slice. */
  limit?: number | null;
  /** Held above the guarantee now (`memory` = `guarantee` + `burst`). */
  burst?: number | null;
  /** The last grow or give-back step, or why a grow was refused, in the pool's words. */
  burst_note?: string | null;
  /** While the kernel gives its burst back: when the pool took it back (epoch s). */
  burst_taken_at?: number | null;
  /** Why this kernel cannot use burst: its enforcement fixed its size when it started. */
  burst_fixed?: string | null;
  /** While a grow waits for room: bytes per GPU the slice waits to grow to. */
  grow_wanted?: number | null;
  /** While a grow waits: when it was first refused for room (epoch s). */
  grow_since?: number | null;
  /** While a grow waits: its 1-based place in line (null where the pool cannot say). */
  grow_place?: number | null;
  num_gpus?: number | null;
}

/**
 * A move of a kernel's GPU memory: parked in host RAM (`suspending`), brought back after a
 * resume (`restoring`), or moved to another GPU of the same model (`migrating`).
 */
export type Transition = 'suspending' | 'restoring' | 'migrating';

/** A kernel's Slurm job, as `GET /api/gpupool/kernels/{kernel_id}` shows it on the Slurm backend. */
export interface ISlurmJob {
  job_id: string | null;
  partition?: string | null;
  node?: string | null;
  gres?: string | null;
  pending_reason?: string | null;
  /** Among the pending jobs of its partition, in Slurm's priority order (1-based). */
  position?: number | null;
  estimated_start?: number | null;
  end_state?: string | null;
}

/** An error answer of the API: `message` is the server's one-line text. */
export class GpuPoolRequestError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
    this.name = 'GpuPoolRequestError';
  }
}

/** One line for a failed request: the server's message, or what the status means. */
export function errorMessage(status: number, body: unknown): string {
  const message =
    body && typeof body === 'object' && 'message' in body
      ? String((body as { message: unknown }).message ?? '')
      : '';
  if (message) {
    return message;
  }
  switch (status) {
    case 400:
      return 'the server refused the request as invalid';
    case 403:
      return 'not allowed: this kernel belongs to someone else';
    case 404:
      return 'not found';
    case 409:
      return 'the request conflicts with the pool state; try again';
    default:
      return `the server answered ${status}`;
  }
}

/** What a server found when it parked a kernel: parked bytes are compared against these. */
export interface IParking {
  /** GPU memory the kernel's process used before it was parked (the watchdog's last reading). */
  used_before?: number | null;
  /** Bytes of framework cache (PyTorch, CuPy) the kernel freed before the checkpoint. */
  cache_freed?: number | null;
  /** Bytes its frameworks said they held live. */
  held?: number | null;
  /** What parked it: `driver checkpoint`, or a framework path such as `torch-memory-saver`. */
  path?: string | null;
  /** Why a faster path was not used. */
  path_note?: string | null;
}
