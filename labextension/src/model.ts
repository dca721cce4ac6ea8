/**
 * The one GPU-pool model of a page: it follows one kernel (the current notebook's),
 * asks the server about it and about the pool with ONE shared `Poll`, and refreshes at
 * once when the server emits a jupyter_gpupool event. Many open notebooks cost one
 * request per tick for the current kernel, plus one for the pool while the panel shows.
 */

import type { Event } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import type { GpuPoolClient } from './api';
import {
  EVENT_SCHEMA_PREFIX,
  GpuPoolRequestError,
  IKernelStatus,
  IPoolSnapshot,
  UNPOOLED_ACTION
} from './types';
import { IKernelView, IPoolView, kernelView, poolView } from './view';

/** What is known about one kernel. */
interface IKernelRecord {
  status: IKernelStatus | null;
  missing: boolean;
  error: string | null;
  eventReason: string | null;
}

/** Options of the model. */
export interface IGpuPoolModelOptions {
  client: GpuPoolClient;
  /** The page's event bus (`app.serviceManager.events`), if any. */
  events?: Event.IManager | null;
  /** Poll interval in ms without server events (default 1000). */
  interval?: number;
  /** Poll interval in ms once server events are seen to arrive (default 2000). */
  eventInterval?: number;
}

const MAX_RECORDS = 64;

/** Shared state of the sidebar, the status bar and the notifications. */
export class GpuPoolModel implements IDisposable {
  constructor(options: IGpuPoolModelOptions) {
    this.client = options.client;
    this._interval = options.interval ?? 1000;
    this._eventInterval = options.eventInterval ?? 2000;
    this._events = options.events ?? null;
    if (this._events) {
      this._events.stream.connect(this._onEvent, this);
    }
    this._poll = new Poll({
      auto: false,
      factory: () => this._tick(),
      frequency: { interval: this._interval, backoff: true, max: 30 * 1000 },
      name: 'jupyter-gpupool:model',
      standby: 'when-hidden'
    });
    void this._poll.start();
  }

  readonly client: GpuPoolClient;

  /** Emitted after every update (poll, event, action, clock tick). */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** The kernel followed now, or null. */
  get kernelId(): string | null {
    return this._kernelId;
  }

  /** A name for the followed kernel (its notebook's path). */
  get kernelLabel(): string {
    return this._kernelLabel;
  }

  /** Whether the pool view is wanted (the panel shows): it is fetched only then. */
  get poolWanted(): boolean {
    return this._poolWanted;
  }
  set poolWanted(value: boolean) {
    if (value === this._poolWanted) {
      return;
    }
    this._poolWanted = value;
    if (value) {
      void this.refresh();
    }
  }

  /** Poll interval (ms) without events; the setting `refreshInterval`. */
  set interval(value: number) {
    this._interval = Math.max(250, value);
    this._updateFrequency();
  }

  /** Whether the server's jupyter_gpupool events were seen on this page. */
  get eventsSeen(): boolean {
    return this._eventsSeen;
  }

  /** Follow `kernelId` (null: none); refreshes at once. */
  setKernel(kernelId: string | null, label = ''): void {
    const changed = kernelId !== this._kernelId || label !== this._kernelLabel;
    this._kernelId = kernelId;
    this._kernelLabel = label;
    if (changed) {
      this._changed.emit();
      void this.refresh();
    }
  }

  /** The server clock (epoch seconds), estimated from the replies. */
  get serverNow(): number {
    return Date.now() / 1000 + this._clockOffset;
  }

  /** The raw reply for the followed kernel. */
  get status(): IKernelStatus | null {
    return this._record()?.status ?? null;
  }

  /** The last pool snapshot. */
  get pool(): IPoolSnapshot | null {
    return this._pool;
  }

  /** Why the last pool request failed, or null. */
  get poolError(): string | null {
    return this._poolError;
  }

  /** The followed kernel's view at the server's now. */
  get view(): IKernelView {
    const record = this._record();
    return kernelView({
      kernelId: this._kernelId,
      status: record?.status ?? null,
      missing: record?.missing ?? false,
      error: record?.error ?? null,
      eventReason: record?.eventReason ?? null,
      now: this.serverNow,
      pool: this._pool
    });
  }

  /** The pool's view, or null before the first snapshot. */
  get poolView(): IPoolView | null {
    return poolView(this._pool, this._kernelId);
  }

  /**
   * Ask the server now. While a tick is under way its answers may predate what prompted this
   * refresh (an event, another kernel followed): one more tick runs as soon as it ends.
   */
  refresh(): Promise<void> {
    if (this._poll.isDisposed) {
      return Promise.resolve();
    }
    if (this._ticking) {
      this._askAgain = true;
      return Promise.resolve();
    }
    return this._poll.refresh();
  }

  /** `POST .../reserve`: resize and/or hold through idle. Throws GpuPoolRequestError. */
  async reserve(
    kernelId: string,
    body: { memory?: string; duration?: string }
  ): Promise<void> {
    this._apply(kernelId, await this.client.reserve(kernelId, body));
  }

  /** `POST .../release`. Throws GpuPoolRequestError. */
  async release(kernelId: string): Promise<void> {
    this._apply(kernelId, await this.client.release(kernelId));
  }

  /** `POST .../keepalive`. Throws GpuPoolRequestError. */
  async keep(kernelId: string, duration: string): Promise<void> {
    this._apply(kernelId, await this.client.keepalive(kernelId, duration));
  }

  /** `POST .../suspend`: park the GPU memory in host RAM. Throws GpuPoolRequestError (409: why not). */
  async suspend(kernelId: string): Promise<void> {
    this._apply(kernelId, await this.client.suspendKernel(kernelId));
  }

  /** `POST .../resume`: queue a suspended kernel to come back. Throws GpuPoolRequestError. */
  async resume(kernelId: string): Promise<void> {
    this._apply(kernelId, await this.client.resumeKernel(kernelId));
  }

  /**
   * The user is working in this kernel's notebook (it got focus, a cell was edited): if the kernel
   * is suspended, ask for its resume now (`{"ahead": true}`), so its memory is on its way before a
   * cell runs. Once per suspension; never throws (a refusal is only logged).
   */
  async resumeAhead(kernelId: string, fresh = false): Promise<boolean> {
    // What the page knows may be from before the kernel was parked (its notebook was in the
    // background): ask the server, on focus always, on edits at most every 2 s.
    const checked = this._aheadChecked.get(kernelId) ?? 0;
    if (fresh || !this._records.get(kernelId)?.status || Date.now() - checked > 2000) {
      this._aheadChecked.set(kernelId, Date.now());
      await this._fetchKernel(kernelId);
    }
    const status = this._records.get(kernelId)?.status ?? null;
    if (!status || status.state !== 'suspended') {
      return false;
    }
    const key = `${kernelId}@${status.suspended_at ?? ''}`;
    if (this._resumedAhead.has(key)) {
      return false;
    }
    this._resumedAhead.add(key);
    try {
      this._apply(kernelId, await this.client.resumeKernel(kernelId, true));
      return true;
    } catch (error) {
      console.warn(`jupyter-gpupool: could not resume kernel ${kernelId} ahead of its next cell: ${(error as Error).message}`);
      return false;
    }
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    // Poll.dispose() leaves its pending timer running; stop() clears it first.
    void this._poll.stop();
    this._poll.dispose();
    this._stopTicker();
    if (this._events) {
      this._events.stream.disconnect(this._onEvent, this);
    }
    Signal.clearData(this);
  }

  private _record(): IKernelRecord | null {
    return this._kernelId ? (this._records.get(this._kernelId) ?? null) : null;
  }

  private _store(kernelId: string, record: Partial<IKernelRecord>): void {
    const previous = this._records.get(kernelId) ?? {
      status: null,
      missing: false,
      error: null,
      eventReason: null
    };
    this._records.delete(kernelId);
    this._records.set(kernelId, { ...previous, ...record });
    while (this._records.size > MAX_RECORDS) {
      const oldest = this._records.keys().next().value as string;
      this._records.delete(oldest);
    }
  }

  private _apply(kernelId: string, reply: IKernelStatus | null): void {
    if (reply && typeof reply === 'object' && 'state' in reply) {
      // An action's answer is newer than any request already under way.
      this._storeAnswer(kernelId, ++this._asked, { status: reply, missing: false, error: null });
      this._changed.emit();
    }
    void this.refresh();
  }

  private _updateClock(serverTime: number | null, precise: boolean): void {
    if (serverTime === null) {
      return;
    }
    const offset = serverTime - Date.now() / 1000;
    // The Date header has whole seconds: only trust it when the clocks differ clearly.
    if (precise || Math.abs(offset - this._clockOffset) > 2) {
      this._clockOffset = precise ? offset : offset + 0.5;
    }
  }

  private async _tick(): Promise<void> {
    this._ticking = true;
    try {
      await this._ask();
    } finally {
      this._ticking = false;
      if (this._askAgain) {
        this._askAgain = false;
        // Once the poll has scheduled its next tick: a refresh now would be folded into this one.
        void this._poll.tick.then(() => this.refresh());
      }
    }
  }

  /** One round of requests: the followed kernel, and the pool when it is wanted. */
  private async _ask(): Promise<void> {
    const kernelId = this._kernelId;
    const jobs: Promise<boolean>[] = [];
    if (kernelId) {
      jobs.push(this._fetchKernel(kernelId));
    }
    // While the pool is unavailable keep asking, so the status bar sees it come back.
    // After an `unpooled` event the pool is read once even with the panel closed, so the
    // snapshot the panel opens on shows the memory used outside the pool.
    if (
      this._poolWanted ||
      this._poolStale ||
      (!this._pool && !this._poolError) ||
      this._pool?.state === 'unavailable'
    ) {
      jobs.push(this._fetchPool());
    }
    const results = await Promise.all(jobs);
    this._changed.emit();
    this._updateTicker();
    if (results.length > 0 && results.every(ok => !ok)) {
      // Nothing answered: let the poll back off.
      throw new Error('GPU pool unavailable');
    }
  }

  private async _fetchKernel(kernelId: string): Promise<boolean> {
    const asked = ++this._asked;
    try {
      const reply = await this.client.kernel(kernelId);
      const precise = typeof reply.data?.now === 'number';
      this._updateClock(precise ? reply.data.now! : reply.serverTime, precise);
      this._storeAnswer(kernelId, asked, { status: reply.data, missing: false, error: null });
      return true;
    } catch (error) {
      if (error instanceof GpuPoolRequestError && error.status === 404) {
        this._storeAnswer(kernelId, asked, { missing: true, error: null });
        return true;
      }
      this._storeAnswer(kernelId, asked, { error: (error as Error).message });
      return false;
    }
  }

  /**
   * Keep an answer about a kernel unless one asked for later is already kept: on a loaded server
   * an older request (asked before a suspend) can answer after a newer one.
   */
  private _storeAnswer(kernelId: string, asked: number, record: Partial<IKernelRecord>): void {
    if (asked < (this._answered.get(kernelId) ?? 0)) {
      return;
    }
    this._answered.set(kernelId, asked);
    this._store(kernelId, record);
  }

  private async _fetchPool(): Promise<boolean> {
    try {
      const reply = await this.client.pool();
      const precise = typeof reply.data?.now === 'number';
      this._updateClock(precise ? reply.data.now! : reply.serverTime, precise);
      this._pool = reply.data;
      this._poolError = null;
      this._poolStale = false;
      return true;
    } catch (error) {
      this._poolError = (error as Error).message;
      return false;
    }
  }

  private _onEvent(_: unknown, event: Event.Emission): void {
    const schema = String(event.schema_id ?? '');
    if (!schema.startsWith(EVENT_SCHEMA_PREFIX)) {
      return;
    }
    if (!this._eventsSeen) {
      this._eventsSeen = true;
      this._updateFrequency();
    }
    // Remember why a slice went away, in case the kernel is gone before we ask.
    const kernelId = event.kernel_id;
    const reason = event.message ?? event.reason ?? event.release_reason;
    const gone =
      event.state === 'released' ||
      ['released', 'reclaimed', 'preempted', 'culled'].includes(String(event.action));
    if (gone && typeof kernelId === 'string' && typeof reason === 'string' && reason) {
      this._store(kernelId, { eventReason: reason });
    }
    // Memory used outside the pool (no lease, no kernel): what changed is the pool view.
    if (event.action === UNPOOLED_ACTION) {
      this._poolStale = true;
    }
    void this.refresh();
  }

  private _updateFrequency(): void {
    const interval = this._eventsSeen
      ? Math.max(this._interval, this._eventInterval)
      : this._interval;
    if (interval !== this._poll.frequency.interval) {
      this._poll.frequency = { ...this._poll.frequency, interval };
    }
  }

  /** A local one-second clock while a countdown shows; it sends no requests. */
  private _updateTicker(): void {
    const counting = this.view.idle !== null;
    if (counting && this._ticker === null) {
      this._ticker = globalThis.setInterval(() => this._changed.emit(), 1000);
    } else if (!counting) {
      this._stopTicker();
    }
  }

  private _stopTicker(): void {
    if (this._ticker !== null) {
      globalThis.clearInterval(this._ticker);
      this._ticker = null;
    }
  }

  private _answered = new Map<string, number>();
  private _askAgain = false;
  private _asked = 0;
  private _changed = new Signal<this, void>(this);
  private _clockOffset = 0;
  private _eventInterval: number;
  private _events: Event.IManager | null;
  private _eventsSeen = false;
  private _interval: number;
  private _kernelId: string | null = null;
  private _kernelLabel = '';
  private _poll: Poll;
  private _pool: IPoolSnapshot | null = null;
  private _poolError: string | null = null;
  private _poolStale = false;
  private _poolWanted = false;
  private _records = new Map<string, IKernelRecord>();
  private _resumedAhead = new Set<string>();
  private _aheadChecked = new Map<string, number>();
  private _ticker: ReturnType<typeof setInterval> | null = null;
  private _ticking = false;
}
