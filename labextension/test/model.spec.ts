/**
 * The page's one model: one request per tick for the current kernel (however many
 * notebooks are open), the pool only while the panel shows, an immediate refresh on a
 * jupyter_gpupool event, 404 read as "no lease".
 */
import { Signal } from '@lumino/signaling';

import type { GpuPoolClient, ITimed } from '../src/api';
import { GpuPoolModel } from '../src/model';
import { GpuPoolRequestError, IKernelStatus, IPoolSnapshot } from '../src/types';
import { GIB } from '../src/units';

const granted = (kernelId: string): IKernelStatus => ({
  lease_id: `lease-${kernelId}`,
  state: 'granted',
  memory: 8 * GIB,
  devices: [{ index: 0, uuid: 'GPU-a', name: 'Simulated', memory_total: 16 * GIB }],
  used_memory: 0,
  now: Date.now() / 1000
});

class FakeClient {
  calls: string[] = [];
  kernels = new Map<string, IKernelStatus | 'missing' | 'down'>();
  pool_: IPoolSnapshot = { devices: [], leases: [], queue: [], viewer: { name: 'me', admin: false } };

  async pool(): Promise<ITimed<IPoolSnapshot>> {
    this.calls.push('pool');
    return { data: this.pool_, serverTime: null };
  }

  /** While set, each kernel request answers what the server held when it was asked, once released. */
  held: Array<() => void> | null = null;

  /** Let the held requests answer, in the order given (indices into the held list). */
  answerHeld(order?: number[]): void {
    const held = this.held ?? [];
    this.held = null;
    for (const index of order ?? held.map((_, i) => i)) {
      held[index]();
    }
  }

  async kernel(id: string): Promise<ITimed<IKernelStatus>> {
    this.calls.push(`kernel:${id}`);
    const answer = this.kernels.get(id);
    if (this.held) {
      const held = this.held;
      await new Promise<void>(resolve => held.push(resolve));
    }
    if (answer === 'down') {
      throw new GpuPoolRequestError('cannot reach the Jupyter server: down', 0);
    }
    if (!answer || answer === 'missing') {
      throw new GpuPoolRequestError('no GPU lease', 404);
    }
    return { data: answer, serverTime: null };
  }

  async keepalive(id: string, duration: string): Promise<IKernelStatus> {
    this.calls.push(`keep:${id}:${duration}`);
    const current = this.kernels.get(id) as IKernelStatus;
    const kept = { ...current, keep_until: (current.now ?? 0) + 3600 };
    this.kernels.set(id, kept);
    return kept;
  }

  /** Why a suspend is refused (409), or null to accept it. */
  refuseSuspend: string | null = null;

  async suspendKernel(id: string): Promise<IKernelStatus> {
    this.calls.push(`suspend:${id}`);
    if (this.refuseSuspend) {
      throw new GpuPoolRequestError(this.refuseSuspend, 409);
    }
    const current = this.kernels.get(id) as IKernelStatus;
    const suspending: IKernelStatus = { ...current, transition: 'suspending' };
    this.kernels.set(id, suspending);
    return suspending;
  }

  async resumeKernel(id: string, ahead = false): Promise<IKernelStatus> {
    this.calls.push(ahead ? `resume-ahead:${id}` : `resume:${id}`);
    const current = this.kernels.get(id) as IKernelStatus;
    const resuming: IKernelStatus = { ...current, state: 'queued', resuming: true, queue_position: 1, queue_length: 1 };
    this.kernels.set(id, resuming);
    return resuming;
  }
}

class FakeEvents {
  stream = new Signal<any, any>(this);
}

/** Resolve when `check` holds, or fail after `timeout` ms (no fixed sleeps). */
async function until(check: () => boolean, timeout = 3000): Promise<void> {
  const deadline = Date.now() + timeout;
  while (!check()) {
    if (Date.now() > deadline) {
      throw new Error('condition not met in time');
    }
    await new Promise(resolve => setTimeout(resolve, 5));
  }
}

function setup(interval = 40) {
  const client = new FakeClient();
  const events = new FakeEvents();
  const model = new GpuPoolModel({
    client: client as unknown as GpuPoolClient,
    events: events as any,
    interval,
    eventInterval: 10 * 1000
  });
  return { client, events, model };
}

describe('GpuPoolModel', () => {
  let model: GpuPoolModel | null = null;
  afterEach(() => model?.dispose());

  it('resumes a suspended kernel ahead of its next cell once per suspension, and a running one never', async () => {
    const s = setup(10 * 1000);
    model = s.model;
    s.client.kernels.set('a', granted('a'));
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'granted');
    expect(await s.model.resumeAhead('a')).toBe(false);
    s.client.kernels.set('a', { ...granted('a'), state: 'suspended', suspended_at: 100, parked_memory: 3 * GIB });
    await s.model.refresh();
    await until(() => s.model.view.phase === 'suspended');
    expect(await s.model.resumeAhead('a')).toBe(true);
    s.client.kernels.set('a', { ...granted('a'), state: 'suspended', suspended_at: 100, parked_memory: 3 * GIB });
    await s.model.refresh();
    await until(() => s.model.view.phase === 'suspended');
    expect(await s.model.resumeAhead('a')).toBe(false); // asked already for this suspension
    s.client.kernels.set('a', { ...granted('a'), state: 'suspended', suspended_at: 200, parked_memory: 3 * GIB });
    await s.model.refresh();
    await until(() => s.model.status?.suspended_at === 200);
    expect(await s.model.resumeAhead('a')).toBe(true); // suspended again: asked again
    expect(s.client.calls.filter(c => c.startsWith('resume'))).toEqual(['resume-ahead:a', 'resume-ahead:a']);
  });

  it('shows parked bytes against used bytes and the cache freed first', async () => {
    const s = setup(10 * 1000);
    model = s.model;
    s.client.kernels.set('a', {
      ...granted('a'),
      state: 'suspended',
      parked_memory: 3 * GIB,
      parking: { used_before: 4 * GIB, cache_freed: 1 * GIB, held: 3 * GIB }
    });
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'suspended');
    expect(s.model.view.suspended?.text).toBe('GPU suspended · 3 GiB parked of 4 GiB used — resumes on your next cell');
    expect(s.model.view.summary).toContain('1 GiB of framework cache was freed first');
  });

  it('says which parking path parked the kernel', async () => {
    const s = setup(10 * 1000);
    model = s.model;
    s.client.kernels.set('a', {
      ...granted('a'),
      state: 'suspended',
      parked_memory: 3 * GIB,
      parking: { used_before: 4 * GIB, cache_freed: null, held: null, path: 'torch-memory-saver', path_note: null }
    });
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'suspended');
    expect(s.model.view.suspended?.text).toBe(
      'GPU suspended · 3 GiB parked of 4 GiB used · parked by torch-memory-saver — resumes on your next cell'
    );
  });

  it('asks only about the current kernel, and about the pool only while wanted', async () => {
    const s = setup();
    model = s.model;
    for (const id of ['a', 'b', 'c']) {
      s.client.kernels.set(id, granted(id));
    }
    s.model.setKernel('b', 'b.ipynb');
    await until(() => s.client.calls.filter(c => c === 'kernel:b').length >= 4);
    expect(s.client.calls.filter(c => c === 'kernel:a' || c === 'kernel:c')).toEqual([]);
    // The pool is asked once at start (for the status), then not while the panel is closed.
    expect(s.client.calls.filter(c => c === 'pool').length).toBe(1);
    expect(s.model.view.statusText).toBe('GPU 0 / 8 GiB');

    s.model.poolWanted = true;
    await until(() => s.client.calls.filter(c => c === 'pool').length >= 3);
    s.model.poolWanted = false;
    const pools = s.client.calls.filter(c => c === 'pool').length;
    const kernelsBefore = s.client.calls.filter(c => c === 'kernel:b').length;
    await until(() => s.client.calls.filter(c => c === 'kernel:b').length >= kernelsBefore + 3);
    expect(s.client.calls.filter(c => c === 'pool').length).toBeLessThanOrEqual(pools + 1);
  });

  it('follows another kernel at once', async () => {
    const s = setup(10 * 1000);
    model = s.model;
    s.client.kernels.set('a', granted('a'));
    s.client.kernels.set('b', { ...granted('b'), state: 'queued', devices: [], queue_position: 1, queue_length: 1 });
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'granted');
    s.model.setKernel('b', 'b.ipynb');
    await until(() => s.model.view.statusText === 'GPU queued #1');
    expect(s.model.kernelLabel).toBe('b.ipynb');
  });

  it('refreshes at once on a jupyter_gpupool event and ignores other events', async () => {
    const s = setup(60 * 1000); // the poll alone would not ask again within the test
    model = s.model;
    s.client.kernels.set('k', { ...granted('k'), state: 'queued', devices: [], queue_position: 1, queue_length: 1 });
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.phase === 'queued');
    const asked = s.client.calls.length;

    s.events.stream.emit({ schema_id: 'https://events.jupyter.org/jupyter_server/kernel_actions/v1', action: 'start' });
    s.client.kernels.set('k', granted('k'));
    s.events.stream.emit({
      schema_id: 'https://events.jupyter.org/jupyter_gpupool/lease/v2',
      action: 'granted',
      lease_id: 'lease-k',
      kernel_id: 'k',
      state: 'granted'
    });
    await until(() => s.model.view.phase === 'granted', 1000);
    expect(s.model.eventsSeen).toBe(true);
    expect(s.client.calls.length - asked).toBeLessThanOrEqual(2);
  });

  it('reads the pool again on an unpooled event, even with the panel closed', async () => {
    const s = setup(60 * 1000); // the poll alone would not ask again within the test
    model = s.model;
    s.client.kernels.set('k', granted('k'));
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.phase === 'granted' && s.model.pool !== null);
    const pools = () => s.client.calls.filter(c => c === 'pool').length;
    const before = pools();

    // A lease event refreshes the kernel, not the pool while the panel is closed.
    const kernels = () => s.client.calls.filter(c => c === 'kernel:k').length;
    const asked = kernels();
    s.events.stream.emit({
      schema_id: 'https://events.jupyter.org/jupyter_gpupool/lease/v2',
      action: 'waiting',
      lease_id: 'lease-x',
      kernel_id: 'x',
      state: 'queued'
    });
    await until(() => kernels() > asked);
    expect(pools()).toBe(before);

    s.client.pool_ = {
      ...s.client.pool_,
      devices: [{ index: 0, uuid: 'GPU-a', name: 'Simulated', memory_total: 16 * GIB, memory_leased: 8 * GIB, memory_unpooled: 3 * GIB }],
      unpooled: [{ device: 'GPU-a', bytes: 3 * GIB, why: 'no lease', since: 0, pid: null, user: null, command: null, host: null, lease_id: null, stoppable: false, mine: false }]
    };
    s.events.stream.emit({
      schema_id: 'https://events.jupyter.org/jupyter_gpupool/lease/v2',
      action: 'unpooled',
      lease_id: null,
      kernel_id: null,
      state: null,
      memory: 3 * GIB,
      message: '3 GiB of GPU GPU-a is used outside the pool; the pool does not grant it'
    });
    await until(() => pools() === before + 1);
    expect(s.model.poolView!.devices[0].outside!.lines).toEqual(['3 GiB used outside the pool']);
    // Once read, the pool is not asked again while the panel stays closed.
    const after = kernels();
    await s.model.refresh();
    await until(() => kernels() > after);
    expect(pools()).toBe(before + 1);
    expect(s.model.view.phase).toBe('granted');
  });

  it('reads 404 as no lease, and a lease that vanished as released with the event’s reason', async () => {
    const s = setup();
    model = s.model;
    s.model.setKernel('plain', 'cpu.ipynb');
    await until(() => s.model.view.phase === 'no-lease');
    expect(s.model.view.statusText).toBe('');

    s.client.kernels.set('k', granted('k'));
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.phase === 'granted');
    s.events.stream.emit({
      schema_id: 'https://events.jupyter.org/jupyter_gpupool/lease/v2',
      action: 'culled',
      lease_id: 'lease-k',
      kernel_id: 'k',
      state: 'released',
      message: 'idle for 30 min while 2 kernels waited'
    });
    s.client.kernels.set('k', 'missing');
    await until(() => s.model.view.phase === 'released');
    expect(s.model.view.released).toBe('idle for 30 min while 2 kernels waited');
  });

  it('keeps asking about an unavailable pool, so the status bar sees it come back', async () => {
    const s = setup();
    model = s.model;
    s.client.pool_ = {
      devices: [],
      leases: [],
      queue: [],
      state: 'unavailable',
      reason: 'no NVIDIA driver found',
      no_gpu: true,
      when_unavailable: 'cpu-only'
    };
    s.model.setKernel(null);
    await until(() => s.model.view.statusText === 'No GPU pool');
    expect(s.model.view.statusTitle).toContain('no NVIDIA driver found');
    s.client.pool_ = { devices: [], leases: [], queue: [], state: 'available', reason: null };
    await until(() => s.model.view.statusText === '');
    expect(s.client.calls.filter(c => c === 'pool').length).toBeGreaterThanOrEqual(2);
  });

  it('shows the server as unavailable when it does not answer', async () => {
    const s = setup();
    model = s.model;
    s.client.kernels.set('k', 'down');
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.phase === 'unavailable');
    expect(s.model.view.summary).toContain('down');
  });

  it('applies an action’s answer without waiting for the next tick', async () => {
    const s = setup(60 * 1000);
    model = s.model;
    s.client.kernels.set('k', granted('k'));
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.phase === 'granted');
    await s.model.keep('k', '1h');
    expect(s.client.calls).toContain('keep:k:1h');
    expect(s.model.view.kept).toMatch(/^kept through idle for another (59 min|1 h)/);
  });

  it('suspends and resumes, showing each answer at once, and passes a refusal on as one line', async () => {
    const s = setup(60 * 1000);
    model = s.model;
    s.client.kernels.set('k', { ...granted('k'), suspendable: true });
    s.model.setKernel('k', 'k.ipynb');
    await until(() => s.model.view.canSuspend);

    s.client.refuseSuspend = 'cannot suspend this kernel: the pool’s reclaim action is cull';
    await expect(s.model.suspend('k')).rejects.toThrow(s.client.refuseSuspend);
    expect(s.model.view.phase).toBe('granted'); // a refusal changes nothing
    expect(s.model.view.transition).toBeNull();

    s.client.refuseSuspend = null;
    await s.model.suspend('k');
    expect(s.model.view.statusText).toBe('GPU suspending…');

    s.client.kernels.set('k', { ...granted('k'), state: 'suspended', devices: [], parked_memory: 6 * GIB });
    await s.model.refresh();
    await until(() => s.model.view.canResume);
    await s.model.resume('k');
    expect(s.model.view.statusText).toBe('Resuming #1');
    expect(s.client.calls.filter(c => /^(suspend|resume):/.test(c))).toEqual(['suspend:k', 'suspend:k', 'resume:k']);
  });

  it('asks again once a request under way ends when an event arrives during it: its answer may predate the event', async () => {
    const s = setup(60 * 1000); // the poll alone would not ask again within the test
    model = s.model;
    s.client.kernels.set('a', granted('a'));
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'granted');
    s.client.held = [];
    void s.model.refresh(); // asked while A is granted; the answer is slow (a loaded server)
    await until(() => s.client.held!.length === 1);
    s.client.kernels.set('a', { ...granted('a'), state: 'suspended', devices: [], parked_memory: 0 });
    s.events.stream.emit({
      schema_id: 'https://events.jupyter.org/jupyter_gpupool/lease/v2',
      action: 'suspended',
      lease_id: 'lease-a',
      kernel_id: 'a',
      state: 'suspended'
    });
    s.client.answerHeld();
    await until(() => s.model.view.phase === 'suspended', 1000);
  });

  it('keeps the newest answer when an older request answers last', async () => {
    const s = setup(60 * 1000);
    model = s.model;
    s.client.kernels.set('a', granted('a'));
    s.model.setKernel('a', 'a.ipynb');
    await until(() => s.model.view.phase === 'granted');
    s.client.held = [];
    const resumed = s.model.resumeAhead('a', true); // a cell edited: asks about A at once; answer held: granted
    await until(() => s.client.held!.length === 1);
    s.client.kernels.set('a', { ...granted('a'), state: 'suspended', suspended_at: 100, devices: [], parked_memory: 0 });
    void s.model.refresh(); // asked after the suspend: suspended
    await until(() => s.client.held!.length === 2);
    s.client.answerHeld([1, 0]); // the newer answer first, the older one last
    // The model goes by the newer answer: A is suspended, so the edit asks for its resume.
    expect(await resumed).toBe(true);
    expect(s.client.calls).toContain('resume-ahead:a');
    expect(s.model.view.phase).not.toBe('granted');
  });
});
