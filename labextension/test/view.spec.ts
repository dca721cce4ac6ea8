import { IKernelStatus, IPoolSnapshot } from '../src/types';
import { GIB, MIB } from '../src/units';
import {
  checkReserve,
  elasticLine,
  enforcementLabel,
  kernelView,
  outsideView,
  poolView,
  quotaLines,
  reservationWindow,
  rightSizeHint
} from '../src/view';

const NOW = 1_700_000_000;
const A100 = { index: 0, uuid: 'GPU-a', name: 'NVIDIA A100-SXM4-80GB', memory_total: 80 * GIB };

function status(overrides: Partial<IKernelStatus>): IKernelStatus {
  return {
    lease_id: 'l1',
    state: 'granted',
    memory: 8 * GIB,
    devices: [A100],
    queue_position: null,
    queue_length: null,
    estimated_wait: null,
    used_memory: null,
    peak_memory: null,
    enforcement: { level: 'soft', mechanisms: ['framework caps', 'watchdog'], description: 'PyTorch cap and NVML watchdog' },
    idle_seconds: 0,
    reclaim_at: null,
    release_reason: null,
    keep_until: null,
    ...overrides
  };
}

function view(s: IKernelStatus | null, extra: Partial<Parameters<typeof kernelView>[0]> = {}) {
  return kernelView({ kernelId: 'k1', status: s, missing: false, error: null, now: NOW, ...extra });
}

describe('kernelView', () => {
  it('names the Slurm job, partition and position of a kernel on the Slurm backend', () => {
    const slurm = { job_id: '12', partition: 'gpu', node: null, position: 1, pending_reason: 'Resources' };
    const queued = view(status({ state: 'queued', devices: [], queue_position: 1, queue_length: 1, slurm }));
    expect(queued.scheduler).toBe('Slurm job 12 · partition gpu · position 1 among pending jobs');
    const running = view(status({ slurm: { job_id: '12', partition: 'gpu', node: 'node0', position: null } }));
    expect(running.scheduler).toBe('Slurm job 12 · partition gpu · node node0');
    expect(view(status({})).scheduler).toBeNull();
  });

  it('says a kernel runs on a kernel gateway, with what it reported of its own slice', () => {
    const gateway = 'http://gw.example:8889';
    const granted = view(status({ gateway }));
    expect(granted.statusText).toBe(view(status({})).statusText);
    expect(granted.scheduler).toBe(
      'on the kernel gateway at http://gw.example:8889: the slice is its host\'s pool\'s (change it with %gpupool in the notebook)'
    );
    expect(granted.statusTitle.endsWith(granted.scheduler as string)).toBe(true);
    const none = view(status({ state: 'none', lease_id: null, gateway, reason: 'it reports no GPU lease from the gateway host\'s pool' }));
    expect(none.phase).toBe('no-lease');
    expect(none.summary).toBe("This kernel holds no GPU slice: it reports no GPU lease from the gateway host's pool.");
    expect(none.scheduler).toContain('on the kernel gateway at http://gw.example:8889');
  });

  it('names the Slurm job in the status bar tooltip too, after what it said before', () => {
    const slurm = { job_id: '12', partition: 'gpu', node: null, position: 1, pending_reason: 'Resources' };
    const queued = view(status({ state: 'queued', devices: [], queue_position: 1, queue_length: 1, slurm }));
    expect(queued.statusText).toBe('GPU queued #1');
    expect(queued.statusTitle).toBe(
      '8 GiB requested; waiting for a GPU — position 1 of 1, wait unknown; ' +
        'Slurm job 12 · partition gpu · position 1 among pending jobs'
    );
    const running = view(status({ slurm: { job_id: '12', partition: 'gpu', node: 'node0', position: null } }));
    expect(running.statusTitle).toBe(
      '8 GiB on GPU 0 · NVIDIA A100-SXM4-80GB; Slurm job 12 · partition gpu · node node0'
    );
    // Other backends: the tooltip is unchanged.
    expect(view(status({})).statusTitle).toBe('8 GiB on GPU 0 · NVIDIA A100-SXM4-80GB');
  });

  it('shows a granted slice in the status bar as used / slice', () => {
    const v = view(status({ used_memory: 3.1 * GIB, peak_memory: 5 * GIB }));
    expect(v.phase).toBe('granted');
    expect(v.statusText).toBe('GPU 3.1 / 8 GiB');
    expect(v.gpu).toBe('GPU 0 · NVIDIA A100-SXM4-80GB');
    expect(v.slice!.fraction).toBeCloseTo(0.1);
    expect(v.slice!.label).toBe('slice 8 GiB of 80 GiB (10%)');
    expect(v.usage!.fraction).toBeCloseTo(3.1 / 8);
    expect(v.usage!.label).toBe('using 3.1 GiB of 8 GiB · peak 5 GiB');
    expect(v.usage!.markers).toEqual([{ fraction: 5 / 8, label: 'peak 5 GiB' }]);
    expect(v.enforcement).toEqual({ level: 'soft', label: 'Soft limit', text: 'PyTorch cap and NVML watchdog' });
    expect(v.canKeep && v.canRelease && v.canReserve).toBe(true);
    expect(v.idle).toBeNull();
    expect(v.overLimit).toBeNull();
  });

  it('shows a dash while usage is not measured yet', () => {
    expect(view(status({})).statusText).toBe('GPU – / 8 GiB');
    expect(view(status({})).usage!.label).toBe('use not measured yet');
  });

  it('shows the queue position, length and wait', () => {
    const v = view(
      status({ state: 'queued', devices: [], queue_position: 2, queue_length: 5, estimated_wait: 240 })
    );
    expect(v.phase).toBe('queued');
    expect(v.statusText).toBe('GPU queued #2');
    expect(v.queue!.text).toBe('waiting for a GPU — position 2 of 5, about 4 min');
    expect(v.slice).toBeNull();
    expect(v.canKeep).toBe(false);
    expect(v.canRelease).toBe(true);
  });

  it('says the wait is unknown when the server cannot tell', () => {
    const v = view(status({ state: 'queued', devices: [], queue_position: 1, queue_length: 1 }));
    expect(v.queue!.text).toBe('waiting for a GPU — position 1 of 1, wait unknown');
    expect(v.statusText).toBe('GPU queued #1');
  });

  it('says the pool is unavailable and retried while a queued wait cannot reach it', () => {
    const reason = 'pool unavailable, retrying in 4 s: the GPU pool broker is not reachable';
    const v = view(
      status({ state: 'queued', devices: [], queue_position: 2, queue_length: 2, queue_reason: reason })
    );
    expect(v.phase).toBe('queued');
    expect(v.statusText).toBe('GPU pool unavailable, retrying');
    expect(v.statusTitle).toContain(reason);
    expect(v.queue).toEqual({ text: 'waiting for a GPU — position 2 of 2, wait unknown', reason });
    expect(v.canRelease).toBe(true);
  });

  it('counts down to an idle reclaim and offers Keep', () => {
    const v = view(
      status({ idle_seconds: 600, reclaim_at: NOW + 272, reclaim_reason: 'idle while 1 kernel waits' })
    );
    expect(v.idle).toEqual({
      text: 'idle for 10 min — slice goes back to the pool in 4:32 unless you keep it',
      countdown: '4:32',
      secondsLeft: 272,
      reason: 'idle while 1 kernel waits',
      suspends: false
    });
    expect(v.statusText).toBe('GPU – / 8 GiB · 4:32');
    expect(v.canKeep).toBe(true);
  });

  it('never counts below zero', () => {
    expect(view(status({ reclaim_at: NOW - 5 })).idle!.countdown).toBe('0:00');
  });

  it('says how long a kept slice is held', () => {
    expect(view(status({ keep_until: NOW + 3600 })).kept).toBe('kept through idle for another 1 h');
    expect(view(status({ keep_until: NOW - 1 })).kept).toBeNull();
  });

  it('says why a slice was released', () => {
    const v = view(status({ state: 'released', release_reason: 'reclaimed: idle 30 min while others waited' }));
    expect(v.phase).toBe('released');
    expect(v.statusText).toBe('GPU released');
    expect(v.released).toBe('reclaimed: idle 30 min while others waited');
    expect(v.canRelease).toBe(false);
  });

  it('treats a lease that disappeared as released, with the reason an event gave', () => {
    const v = view(status({}), { missing: true, eventReason: 'culled: idle while others waited' });
    expect(v.phase).toBe('released');
    expect(v.released).toBe('culled: idle while others waited');
  });

  it('shows nothing in the status bar for a kernel without a lease', () => {
    for (const v of [view(null, { missing: true }), view(status({ state: 'none', memory: 0, devices: [] }))]) {
      expect(v.phase).toBe('no-lease');
      expect(v.statusText).toBe('');
      expect(v.canRelease).toBe(false);
    }
  });

  it('without a kernel, asks to open a notebook', () => {
    const v = kernelView({ kernelId: null, status: null, missing: false, error: null, now: NOW });
    expect(v.phase).toBe('no-kernel');
    expect(v.statusText).toBe('');
  });

  it('reports an unreachable pool once, without stale data', () => {
    const v = view(null, { error: 'cannot reach the Jupyter server: Failed to fetch' });
    expect(v.phase).toBe('unavailable');
    expect(v.summary).toContain('Failed to fetch');
  });

  it('warns when usage is above the slice', () => {
    const v = view(status({ used_memory: 9 * GIB, over_limit_since: NOW - 30 }));
    expect(v.usage!.warn).toBe(true);
    expect(v.usage!.fraction).toBe(1);
    expect(v.overLimit).toContain('using 9 GiB, above the 8 GiB slice for 30 s');
  });

  it('tolerates a device the server could not describe', () => {
    const v = view(status({ devices: [{ uuid: 'GPU-x', index: null, name: null, memory_total: null }] }));
    expect(v.gpu).toBe('GPU ? · unknown GPU');
    expect(v.slice).toBeNull();
    expect(v.statusText).toBe('GPU – / 8 GiB');
  });
});

describe('kernelView of a suspended kernel', () => {
  const REASON = 'reclaimed: idle for 31 min while 2 requests waited for a GPU';
  const suspended = (overrides: Partial<IKernelStatus> = {}) =>
    status({
      state: 'suspended',
      devices: [],
      suspendable: true,
      suspend_reason: REASON,
      suspended_at: NOW - 60,
      parked_memory: 6.2 * GIB,
      home_devices: ['GPU-a'],
      ...overrides
    });

  it('says how much is parked, that the next cell resumes it, and why; offers Resume', () => {
    const v = view(suspended());
    expect(v.phase).toBe('suspended');
    expect(v.suspended).toEqual({
      text: 'GPU suspended · 6.2 GiB parked — resumes on your next cell',
      reason: REASON
    });
    expect(v.statusText).toBe('GPU suspended');
    expect(v.statusTitle).toBe(`GPU suspended · 6.2 GiB parked — resumes on your next cell (${REASON})`);
    expect(v.summary).toBe('8 GiB slice suspended: the kernel keeps its variables, its GPU memory waits in host RAM.');
    expect(v.canResume).toBe(true);
    expect(v.canSuspend || v.canKeep || v.canReserve).toBe(false);
    expect(v.canRelease).toBe(true);
    // No GPU while parked: no bars, no idle countdown, no hint.
    expect([v.slice, v.usage, v.idle, v.hint, v.transition, v.queue]).toEqual([null, null, null, null, null, null]);
  });

  it('leaves the size out when the server does not say how much is parked, and the reason when none', () => {
    const v = view(suspended({ parked_memory: null, suspend_reason: null }));
    expect(v.suspended).toEqual({ text: 'GPU suspended — resumes on your next cell', reason: '' });
    expect(v.statusTitle).toBe('GPU suspended — resumes on your next cell');
  });

  it('shows a kernel waiting to resume like a queued one, with its position, wait and reason', () => {
    const v = view(
      suspended({
        state: 'queued',
        resuming: true,
        queue_position: 2,
        queue_length: 3,
        estimated_wait: 240,
        queue_reason: 'pool full'
      })
    );
    expect(v.phase).toBe('queued');
    expect(v.badge).toBe('resuming');
    expect(v.queue).toEqual({
      text: 'resuming — waiting for a GPU, position 2 of 3, about 4 min',
      reason: 'pool full'
    });
    expect(v.statusText).toBe('Resuming #2');
    expect(v.statusTitle).toBe('GPU suspended · 6.2 GiB parked; resuming — waiting for a GPU, position 2 of 3, about 4 min');
    expect(v.summary).toBe('GPU suspended · 6.2 GiB parked — resumes when a GPU is free; a cell run now waits, then runs.');
    expect(v.suspended).toBeNull();
    expect(v.canResume || v.canSuspend || v.canKeep).toBe(false);
    expect(v.canRelease).toBe(true);
  });

  it('says "Resuming" without a position when the server gives none', () => {
    const v = view(suspended({ state: 'queued', resuming: true }));
    expect(v.statusText).toBe('Resuming');
    expect(v.queue!.text).toBe('resuming — waiting for a GPU, in the queue, wait unknown');
  });

  it('names each move of the GPU memory in the panel, the status bar and the badge', () => {
    const cases: Array<[IKernelStatus['transition'], string, string, string]> = [
      ['suspending', 'suspending — parking GPU memory in host RAM…', 'GPU suspending…', 'suspending'],
      ['restoring', 'resuming — restoring GPU memory…', 'GPU resuming…', 'resuming'],
      ['migrating', 'moving to another GPU…', 'GPU moving…', 'moving']
    ];
    for (const [transition, text, statusText, badge] of cases) {
      const v = view(status({ transition, suspendable: true, reclaim_at: NOW + 30, peak_memory: 2.1 * GIB }));
      expect([v.transition, v.statusText, v.badge]).toEqual([text, statusText, badge]);
      expect(v.phase).toBe('granted');
      expect(v.statusTitle).toBe(`${text}; 8 GiB on GPU 0 · NVIDIA A100-SXM4-80GB`);
      // Nothing to act on while the memory moves, but Release.
      expect(v.canSuspend || v.canKeep || v.canReserve || v.canResume).toBe(false);
      expect(v.canRelease).toBe(true);
      expect(v.idle).toBeNull();
      expect(v.hint).toBeNull();
    }
  });

  it('offers Suspend only for a running kernel whose server can park GPU memory', () => {
    expect(view(status({ suspendable: true })).canSuspend).toBe(true);
    expect(view(status({ suspendable: false })).canSuspend).toBe(false);
    expect(view(status({})).canSuspend).toBe(false); // an older server says nothing
    expect(view(status({ suspendable: true, transition: 'migrating' })).canSuspend).toBe(false);
    expect(view(status({ state: 'queued', devices: [], suspendable: true })).canSuspend).toBe(false);
    const plain = view(status({ suspendable: true }));
    expect([plain.transition, plain.badge, plain.suspended]).toEqual([null, null, null]);
  });

  it('warns that an idle suspendable kernel will be suspended (variables kept), not shut down', () => {
    const v = view(
      status({ suspendable: true, idle_seconds: 600, reclaim_at: NOW + 272, reclaim_reason: 'idle while 1 kernel waits' })
    );
    expect(v.idle).toEqual({
      text: 'idle for 10 min — the kernel will be suspended (variables kept) in 4:32 unless you keep it',
      countdown: '4:32',
      secondsLeft: 272,
      reason: 'idle while 1 kernel waits',
      suspends: true
    });
    expect(v.statusText).toBe('GPU – / 8 GiB · 4:32');
    const preempted = view(status({ suspendable: true, reclaim_at: NOW + 60, reclaim_reason: 'preempted for a high-priority request' }));
    expect(preempted.idle!.text).toBe('the kernel will be suspended (variables kept) in 1:00 unless you keep it');
    expect(view(status({ suspendable: false, reclaim_at: NOW + 60 })).idle!.suspends).toBe(false);
  });
});

describe('rightSizeHint', () => {
  it('suggests the peak plus a quarter, in whole GiB', () => {
    expect(rightSizeHint(8 * GIB, 2.1 * GIB)).toEqual({
      text: 'peaked at 2.1 GiB of 8 — shrink to 3 GiB?',
      memory: '3GiB',
      button: 'Shrink to 3 GiB'
    });
  });

  it('names both units when they differ', () => {
    expect(rightSizeHint(8 * GIB, 300 * MIB)!.text).toBe('peaked at 300 MiB of 8 GiB — shrink to 1 GiB?');
  });

  it('stays quiet when the slice fits or nothing was measured', () => {
    expect(rightSizeHint(8 * GIB, 5 * GIB)).toBeNull();
    expect(rightSizeHint(8 * GIB, 3.5 * GIB)).toBeNull(); // 5 GiB suggested > half of 8
    expect(rightSizeHint(1.5 * GIB, 0.1 * GIB)).toBeNull(); // 1 GiB is more than half of 1.5
    expect(rightSizeHint(8 * GIB, null)).toBeNull();
    expect(rightSizeHint(8 * GIB, 0)).toBeNull();
  });

  it('is shown for granted leases only', () => {
    expect(view(status({ peak_memory: 2.1 * GIB })).hint).not.toBeNull();
    expect(view(status({ state: 'suspended', peak_memory: 2.1 * GIB })).hint).toBeNull();
  });
});

describe('reservations', () => {
  const base: IPoolSnapshot = { devices: [], leases: [], queue: [], now: NOW };
  // Windows built in the browser's local time, so the test holds in any time zone.
  const at = (h: number, m = 0) => new Date(2026, 11, 1, h, m).getTime() / 1000; // Tue 1 Dec 2026

  it('lists name, who, memory, window in local time and whether active, open ones first', () => {
    const v = poolView(
      {
        ...base,
        reservations: [
          { name: 'later', memory: 2 * GIB, users: ['bob'], start: at(14), end: at(15, 30), active: false },
          { name: 'lab', memory: 40 * GIB, groups: ['cs101'], weekdays: ['tue', 'thu'], daily_start: '09:00', daily_end: '11:00', active: true }
        ]
      },
      null,
      'en-GB'
    )!;
    expect(v.reservations.map(({ key, ...r }) => r)).toEqual([
      { name: 'lab', who: 'cs101', memory: '40 GiB', window: 'every Tue, Thu 09:00–11:00', active: true },
      { name: 'later', who: 'bob', memory: '2 GiB', window: 'Tue 1 Dec, 14:00–15:30', active: false }
    ]);
  });

  it('writes a window in the user\'s locale', () => {
    const window = reservationWindow({ name: 'x', memory: GIB, start: at(14), end: at(15, 30) }, 'de-DE');
    expect(window).toMatch(/^Di\., 1\. Dez\., 14:00\s?–\s?15:30 Uhr$/);
  });

  it('spells out both ends of a window across days, and copes with older servers', () => {
    // Intl sets thin spaces around the dash between two days.
    expect(reservationWindow({ name: 'x', memory: GIB, start: at(22), end: at(22) + 4 * 3600 }, 'en-GB')).toMatch(
      /^Tue 1 Dec, 22:00\s–\sWed 2 Dec, 02:00$/
    );
    expect(poolView(base, null)!.reservations).toEqual([]);
  });
});

describe('poolView', () => {
  const snapshot: IPoolSnapshot = {
    devices: [
      { index: 0, uuid: 'GPU-a', name: 'Simulated 16GiB', memory_total: 16 * GIB, memory_leased: 16 * GIB, memory_used: 4 * GIB, healthy: true },
      { index: 1, uuid: 'GPU-b', name: 'Simulated 16GiB', memory_total: 16 * GIB, memory_leased: 0, memory_used: 0, healthy: false, health_reason: 'GPU is lost' }
    ],
    leases: [
      { id: null, owner: null, kernel_id: null, memory: 8 * GIB, devices: ['GPU-a'], state: 'granted', mine: false },
      { id: 'l1', owner: 'alice', kernel_id: 'k1', memory: 4 * GIB, devices: ['GPU-a'], state: 'granted', mine: true, label: 'a.ipynb' },
      { id: 'l2', owner: 'alice', kernel_id: 'k2', memory: 4 * GIB, devices: ['GPU-a'], state: 'granted', mine: true },
      { id: 'l3', owner: 'alice', kernel_id: 'k3', memory: 8 * GIB, devices: [], state: 'queued', mine: true }
    ],
    queue: [{ mine: true }, { mine: false }],
    quota: { guaranteed: 0, maximum: 24 * GIB, max_leases: null, held: 8 * GIB, leases: 3, gib_hours_this_month: 1.234 },
    viewer: { name: 'alice', admin: false },
    now: NOW
  };

  it('stacks leases per GPU, own first, the current kernel marked, others anonymous', () => {
    const v = poolView(snapshot, 'k1')!;
    const [gpu0, gpu1] = v.devices;
    expect(gpu0.title).toBe('GPU 0 · Simulated 16GiB');
    expect(gpu0.segments.map(s => [s.fraction, s.mine, s.current, s.label])).toEqual([
      [0.25, true, true, 'you: 4 GiB — a.ipynb'],
      [0.25, true, false, 'you: 4 GiB'],
      [0.5, false, false, 'another user: 8 GiB']
    ]);
    expect(new Set(gpu0.segments.map(s => s.key)).size).toBe(3);
    expect(gpu0.usedFraction).toBe(0.25);
    expect(gpu0.text).toBe('16 GiB of 16 GiB leased, 0 B free · 4 GiB in use');
    expect(gpu0.ariaLabel).toContain('another user: 8 GiB');
    expect(gpu1.healthy).toBe(false);
    expect(gpu1.text).toBe('unhealthy: GPU is lost');
    expect(v.queueText).toBe('2 waiting (1 yours)');
    expect(v.user).toBe('alice');
    expect(v.largestGpu).toBe(16 * GIB);
  });

  it('names owners for admins', () => {
    const admin = { ...snapshot, viewer: { name: 'root', admin: true } };
    admin.leases = [{ ...snapshot.leases[0], owner: 'bob', id: 'l9' }];
    expect(poolView(admin, null)!.devices[0].segments[0].label).toBe('bob: 8 GiB');
  });

  it('words the quota and the GiB-hours used', () => {
    expect(poolView(snapshot, null)!.quota).toEqual([
      { label: 'Guaranteed to you', value: 'none' },
      { label: 'Most you can hold', value: '24 GiB' },
      { label: 'Leases at most', value: 'no limit' },
      { label: 'Holding now', value: '8 GiB' },
      { label: 'Leases now', value: '3' },
      { label: 'Used this month', value: '1.2 GiB·h' }
    ]);
  });

  it('keeps unknown quota fields readable', () => {
    expect(quotaLines({ gib_hours_budget: 100, max_duration_seconds: 7200, tier: 'gold' })).toEqual([
      { label: 'Gib hours budget', value: '100 GiB·h' },
      { label: 'Max duration seconds', value: '2 h' },
      { label: 'Tier', value: 'gold' }
    ]);
    expect(quotaLines(undefined)).toEqual([]);
  });

  it('says when no one waits', () => {
    expect(poolView({ ...snapshot, queue: [] }, null)!.queueText).toBe('no one waiting');
    expect(poolView(null, null)).toBeNull();
  });
});

describe('checkReserve', () => {
  it('accepts a size, a duration, or both, as typed', () => {
    expect(checkReserve('12GiB', '2h', 80 * GIB, 80 * GIB)).toMatchObject({ ok: true, body: { memory: '12GiB', duration: '2h' } });
    expect(checkReserve(' 25% ', '', 80 * GIB, 80 * GIB)).toMatchObject({ ok: true, body: { memory: '25%' } });
    expect(checkReserve('', '1h 30m', null, null)).toMatchObject({ ok: true, body: { duration: '1h30m' } });
  });

  it('wants at least one field', () => {
    expect(checkReserve(' ', '', null, null)).toMatchObject({ ok: false, formError: 'enter a size, a duration, or both' });
  });

  it('names the accepted forms for bad input, field by field', () => {
    const c = checkReserve('lots', 'soon', 80 * GIB, 80 * GIB);
    expect(c.ok).toBe(false);
    expect(c.body).toEqual({});
    expect(c.sizeError).toContain('8GiB, 8G, 8GB, 512MiB');
    expect(c.durationError).toContain('90s, 30m, 2h, 1h30m');
  });

  it('refuses more than the GPU has, saying the most one may ask', () => {
    expect(checkReserve('90GiB', '', 80 * GIB, 80 * GIB).sizeError).toBe(
      'requested 90 GiB but the largest GPU has 80 GiB; ask for at most 80 GiB'
    );
  });

  it('takes a percentage of the largest GPU while queued (no GPU yet)', () => {
    expect(checkReserve('50%', '', null, 16 * GIB).ok).toBe(true);
    expect(checkReserve('50%', '', null, null).sizeError).toContain('a percentage needs a GPU');
  });
});

describe('an unavailable pool and failed starts', () => {
  const unavailablePool: IPoolSnapshot = {
    devices: [],
    leases: [],
    queue: [],
    state: 'unavailable',
    reason: 'no NVIDIA driver found (NVML: NVML Shared Library Not Found)',
    no_gpu: true,
    when_unavailable: 'cpu-only'
  };

  it('shows a CPU-only kernel with the reason in the panel and the status bar', () => {
    const v = view(
      status({ state: 'unavailable', lease_id: null, memory: 0, devices: [], reason: 'pool file is corrupt' })
    );
    expect(v.phase).toBe('cpu-only');
    expect(v.statusText).toBe('GPU pool unavailable');
    expect(v.statusTitle).toContain('pool file is corrupt');
    expect(v.summary).toContain('CPU-only');
    expect(v.canKeep || v.canRelease || v.canReserve).toBe(false);
  });

  it('says the kernel still runs CPU-only once the pool is back', () => {
    const v = view(status({ state: 'unavailable', lease_id: null, memory: 0, devices: [], reason: 'x (restart)' }), {
      pool: { state: 'available', reason: null }
    });
    expect(v.phase).toBe('cpu-only');
    expect(v.statusText).toBe('GPU: CPU only');
  });

  it('says "No GPU pool" when the host simply has no GPU', () => {
    const v = view(status({ state: 'unavailable', lease_id: null, memory: 0, devices: [], reason: null }), {
      pool: unavailablePool
    });
    expect(v.statusText).toBe('No GPU pool');
    expect(v.statusTitle).toContain('no NVIDIA driver found');
  });

  it('shows a failed start as failed with its reason, not as a kernel without a slice', () => {
    const v = view(
      status({
        state: 'failed',
        lease_id: null,
        memory: 0,
        devices: [],
        reason: 'no GPU slice: requested 64 GiB but the largest GPU has 16 GiB'
      })
    );
    expect(v.phase).toBe('failed');
    expect(v.statusText).toBe('GPU start failed');
    expect(v.summary).toBe('This kernel did not start: no GPU slice: requested 64 GiB but the largest GPU has 16 GiB');
    expect(v.summary).not.toContain('holds no GPU slice');
  });

  it('puts an unavailable pool in the status bar even with no kernel open', () => {
    const v = kernelView({ kernelId: null, status: null, missing: false, error: null, now: NOW, pool: unavailablePool });
    expect(v.phase).toBe('no-kernel');
    expect(v.statusText).toBe('No GPU pool');
    expect(v.statusTitle).toContain('kernels run CPU-only');
    const refused = kernelView({
      kernelId: null,
      status: null,
      missing: false,
      error: null,
      now: NOW,
      pool: { ...unavailablePool, no_gpu: false, when_unavailable: 'refuse', reason: 'broker down' }
    });
    expect(refused.statusText).toBe('GPU pool unavailable');
    expect(refused.statusTitle).toBe('GPU pool unavailable: broker down; kernels are refused until it is back');
  });

  it('says the server does not answer in the status bar too', () => {
    const v = view(null, { error: 'cannot reach the Jupyter server: offline' });
    expect(v.phase).toBe('unavailable');
    expect(v.statusText).toBe('GPU pool unavailable');
  });

  it('gives the pool view the reason and what kernels do meanwhile', () => {
    const pv = poolView(unavailablePool, null)!;
    expect(pv.unavailable).toEqual({
      title: 'No GPU pool',
      reason: 'no NVIDIA driver found (NVML: NVML Shared Library Not Found)',
      kernels: 'Kernels run CPU-only (no GPU) until the pool is back; restart a kernel then to get a slice.'
    });
    expect(pv.devices).toEqual([]);
    const available = poolView({ ...unavailablePool, state: 'available', reason: null }, null)!;
    expect(available.unavailable).toBeNull();
  });
});

describe('memory used outside the pool', () => {
  /** A 16 GiB GPU with 8 GiB leased to alice, and 5 GiB held by processes without a lease. */
  const snapshot = (admin: boolean): IPoolSnapshot => ({
    devices: [
      { index: 0, uuid: 'GPU-a', name: 'Simulated 16GiB', memory_total: 16 * GIB, memory_leased: 8 * GIB, memory_used: 9 * GIB, memory_unpooled: 5 * GIB },
      { index: 1, uuid: 'GPU-b', name: 'Simulated 16GiB', memory_total: 16 * GIB, memory_leased: 0, memory_used: 0, memory_unpooled: 0 }
    ],
    leases: [{ id: 'l1', owner: 'alice', kernel_id: 'k1', memory: 8 * GIB, devices: ['GPU-a'], state: 'granted', mine: true }],
    queue: [],
    unpooled: admin
      ? [
          { device: 'GPU-a', bytes: 2 * GIB, why: 'no lease', since: NOW, pid: 4242, user: 'alice', command: 'python train.py --epochs 3', host: 'h', lease_id: null, stoppable: true, mine: false },
          { device: 'GPU-a', bytes: 3 * GIB, why: 'its lease is suspended', since: NOW, pid: 5151, user: 'bob', command: 'python -m ipykernel_launcher -f /run/kernel-1234567890abcdef.json', host: 'h', lease_id: 'l7', stoppable: true, mine: false }
        ]
      : [
          { device: 'GPU-a', bytes: 2 * GIB, why: 'no lease', since: NOW, pid: 4242, user: 'alice', command: 'python train.py --epochs 3', host: 'h', lease_id: null, stoppable: true, mine: true },
          { device: 'GPU-a', bytes: 3 * GIB, why: 'its lease is suspended', since: NOW, pid: null, user: null, command: null, host: null, lease_id: null, stoppable: false, mine: false }
        ],
    viewer: admin ? { name: 'root', admin: true } : { name: 'alice', admin: false },
    now: NOW
  });

  it('draws it as its own segment after the leases, and free memory shrinks by it', () => {
    const v = poolView(snapshot(false), 'k1')!;
    const [gpu0, gpu1] = v.devices;
    expect(gpu0.segments.map(s => [s.fraction, s.outside, s.mine, s.label])).toEqual([
      [0.5, false, true, 'you: 8 GiB'],
      [5 / 16, true, false, 'outside the pool: 5 GiB']
    ]);
    expect(gpu0.text).toBe('8 GiB of 16 GiB leased, 5 GiB used outside the pool, 3 GiB free · 9 GiB in use');
    expect(gpu0.ariaLabel).toContain('outside the pool: 5 GiB');
    expect(gpu1.outside).toBeNull();
    expect(gpu1.segments).toEqual([]);
    expect(gpu1.text).toBe('0 B of 16 GiB leased, 16 GiB free · 0 B in use');
    expect(v.outside).toBe(true);
  });

  it("lists the viewer's own processes and only says 'used outside the pool' of the others", () => {
    const outside = poolView(snapshot(false), null)!.devices[0].outside!;
    expect(outside.bytes).toBe(5 * GIB);
    expect(outside.lines).toEqual([
      'pid 4242 · alice (you) · python train.py --epochs 3 — 2 GiB (no lease)',
      '3 GiB used outside the pool'
    ]);
    expect(outside.lines.join(' ')).not.toMatch(/suspended|5151|bob/);
  });

  it('lists every process for an admin: pid, user, command (cut short), why', () => {
    expect(poolView(snapshot(true), null)!.devices[0].outside!.lines).toEqual([
      'pid 5151 · bob · python -m ipykernel_launcher -f /run/ke… — 3 GiB (its lease is suspended)',
      'pid 4242 · alice · python train.py --epochs 3 — 2 GiB (no lease)'
    ]);
  });

  it('fits the segment into what the slices leave of the bar; the text says how much', () => {
    const full = snapshot(false);
    full.devices[0] = { ...full.devices[0], memory_leased: 14 * GIB };
    full.leases = [{ ...full.leases[0], memory: 14 * GIB }];
    const gpu0 = poolView(full, null)!.devices[0];
    expect(gpu0.segments.map(s => s.fraction)).toEqual([14 / 16, 2 / 16]);
    expect(gpu0.text).toBe('14 GiB of 16 GiB leased, 5 GiB used outside the pool, 0 B free · 9 GiB in use');
  });

  it('counts items when the device gives no total, and bytes no item accounts for as unnamed', () => {
    expect(outsideView(undefined, [{ device: 'GPU-a', bytes: GIB, why: 'no lease', pid: null }])).toEqual({
      bytes: GIB,
      label: 'outside the pool: 1 GiB',
      lines: ['1 GiB used outside the pool']
    });
    expect(outsideView(4 * GIB, [{ device: 'GPU-a', bytes: GIB, why: 'no lease', pid: 7, user: 'bob', command: 'python' }])!.lines).toEqual([
      'pid 7 · bob · python — 1 GiB (no lease)',
      '3 GiB used outside the pool'
    ]);
    expect(outsideView(GIB, [{ device: 'GPU-a', bytes: GIB, why: 'no lease', pid: 7, user: 'bob', command: '/opt/conda/bin/python3 /home/bob/train.py' }])!.lines).toEqual([
      'pid 7 · bob · python3 /home/bob/train.py — 1 GiB (no lease)'
    ]);
    expect(outsideView(0, [])).toBeNull();
    expect(outsideView(undefined, [])).toBeNull();
  });

  it('shows nothing outside the pool from a server that does not report it', () => {
    const old = snapshot(false);
    old.devices = old.devices.map(({ memory_unpooled, ...d }) => d);
    delete old.unpooled;
    const v = poolView(old, null)!;
    expect(v.outside).toBe(false);
    expect(v.devices[0].segments.map(s => s.outside)).toEqual([false]);
    expect(v.devices[0].text).toBe('8 GiB of 16 GiB leased, 8 GiB free · 9 GiB in use');
  });
});

describe('enforcementLabel', () => {
  it('names each level in two words', () => {
    expect(['soft', 'strong', 'hard', 'none', 'unknown'].map(enforcementLabel)).toEqual([
      'Soft limit',
      'Strong limit',
      'Hard limit',
      'No limit',
      'Limit'
    ]);
  });
});

describe('elastic slices', () => {
  const elastic = (overrides: Partial<IKernelStatus>) =>
    status({ memory: 9.2 * GIB, guarantee: 4 * GIB, limit: 40 * GIB, burst: 5.2 * GIB, num_gpus: 1, ...overrides });

  it('words the slice as %gpupool status does: guaranteed, now, up to', () => {
    expect(elasticLine(elastic({}))).toBe('4 GiB guaranteed · 9.2 GiB now, up to 40 GiB');
    expect(elasticLine(elastic({ memory: 4 * GIB, burst: 0 }))).toBe('4 GiB guaranteed · 4 GiB now, up to 40 GiB');
    expect(elasticLine(elastic({ memory: 512 * MIB, guarantee: 512 * MIB, limit: 2 * GIB }))).toBe(
      '512 MiB guaranteed · 512 MiB now, up to 2 GiB'
    );
    // All its GPUs together, as the Python line counts them.
    expect(elasticLine(elastic({ memory: 6 * GIB, guarantee: 4 * GIB, limit: 8 * GIB, num_gpus: 2 }))).toBe(
      '8 GiB guaranteed · 12 GiB now, up to 16 GiB'
    );
  });

  it('offers to shrink an elastic slice only below its guarantee, never the burst it holds', () => {
    // 2 GiB guaranteed, grown to 8 GiB for a 6 GiB peak: nothing to shrink.
    expect(view(elastic({ memory: 8 * GIB, guarantee: 2 * GIB, limit: 16 * GIB, peak_memory: 6 * GIB })).hint).toBeNull();
    // 16 GiB guaranteed, peaked at 2 GiB: shrink the guarantee.
    expect(view(elastic({ memory: 16 * GIB, guarantee: 16 * GIB, limit: 64 * GIB, peak_memory: 2 * GIB })).hint!.button).toBe(
      'Shrink to 3 GiB'
    );
  });

  it('leaves a fixed slice, and a server without elastic slices, as they were', () => {
    expect(elasticLine(status({ guarantee: 8 * GIB, limit: 8 * GIB }))).toBe('');
    expect(elasticLine(status({}))).toBe('');
    const fixed = view(status({ guarantee: 8 * GIB, limit: 8 * GIB, burst: 0, burst_note: null }));
    const before = view(status({}));
    expect(fixed.elastic).toBeNull();
    expect(fixed.burstFixed).toBeNull();
    expect([fixed.summary, fixed.statusText, fixed.statusTitle]).toEqual([before.summary, before.statusText, before.statusTitle]);
  });

  it('shows the line in the sidebar and the status bar tooltip, with the last step', () => {
    const v = view(elastic({ used_memory: 8 * GIB, burst_note: 'grown to 9.2 GiB on demand (4 GiB guaranteed, up to 40 GiB)' }));
    expect(v.elastic).toEqual({
      line: '4 GiB guaranteed · 9.2 GiB now, up to 40 GiB',
      step: 'grown to 9.2 GiB on demand (4 GiB guaranteed, up to 40 GiB)',
      takenBack: false,
      waiting: null
    });
    expect(v.statusText).toBe('GPU 8 / 9.2 GiB');
    expect(v.statusTitle).toBe('4 GiB guaranteed · 9.2 GiB now, up to 40 GiB; GPU 0 · NVIDIA A100-SXM4-80GB, using 8 GiB');
  });

  it('says why burst was taken back, or why the slice did not grow, in the pool\'s words', () => {
    const taken = view(
      elastic({
        memory: 4 * GIB,
        burst: 0,
        used_memory: 6 * GIB,
        burst_taken_at: NOW - 3,
        burst_note: 'burst taken back for a request of 12 GiB: the slice is 4 GiB now (4 GiB guaranteed)'
      })
    );
    expect(taken.elastic?.takenBack).toBe(true);
    expect(taken.elastic?.step).toBe('burst taken back for a request of 12 GiB: the slice is 4 GiB now (4 GiB guaranteed)');
    // Once its burst is taken back, use above its size is what the watchdog acts on.
    expect(taken.overLimit).toBe('using 6 GiB, above the 4 GiB slice — free memory or reserve more, or the kernel may be stopped');
    const refused = view(elastic({ burst_note: 'the slice was not grown: the GPU is full (3 other slice(s) there are guaranteed 60 GiB); it stays 9.2 GiB' }));
    expect(refused.elastic?.step).toMatch(/^the slice was not grown: the GPU is full/);
    expect(refused.elastic?.takenBack).toBe(false);
  });

  it('says a grow that waits for room, to what size, since when (local time) and its place in line', () => {
    const since = new Date(2026, 11, 1, 14, 2, 30).getTime() / 1000;
    const gb = { locale: 'en-GB' };
    const waiting = view(elastic({ grow_wanted: 12 * GIB, grow_since: since, grow_place: 2 }), gb);
    expect(waiting.elastic?.waiting).toBe('waiting to grow to 12 GiB since 14:02 (2nd in line)');
    expect(view(elastic({ grow_wanted: 12 * GIB, grow_since: since, grow_place: 1 }), gb).elastic?.waiting).toBe(
      'waiting to grow to 12 GiB since 14:02 (next in line)'
    );
    // Across two GPUs the size is the slice's whole; a pool that cannot say the place leaves it out.
    expect(view(elastic({ num_gpus: 2, grow_wanted: 12 * GIB, grow_since: since }), gb).elastic?.waiting).toBe(
      'waiting to grow to 24 GiB since 14:02'
    );
    // The clock is written as the user's locale writes it.
    expect(view(elastic({ grow_wanted: 12 * GIB, grow_since: since }), { locale: 'en-US' }).elastic?.waiting).toMatch(
      /^waiting to grow to 12 GiB since 02:02\sPM$/
    );
    expect(view(elastic({ grow_wanted: null, grow_since: null })).elastic?.waiting).toBeNull();
  });

  it('does not warn about use above the current size while the slice may still grow to its limit', () => {
    const growing = view(elastic({ used_memory: 12 * GIB }));
    expect(growing.overLimit).toBeNull();
    expect(growing.usage?.warn).toBe(false);
    const over = view(elastic({ used_memory: 41 * GIB }));
    expect(over.overLimit).toBe(
      "using 41 GiB, above the 40 GiB slice's limit — free memory or reserve more, or the kernel may be stopped"
    );
  });

  it('says briefly when enforcement fixed the size at start', () => {
    const mps = view(elastic({ burst_fixed: "CUDA MPS set this kernel's memory limit when it started" }));
    expect(mps.burstFixed).toBe("No burst: CUDA MPS set this kernel's memory limit when it started.");
    expect(mps.elastic?.line).toBe('4 GiB guaranteed · 9.2 GiB now, up to 40 GiB');
    const slurm = view(status({ guarantee: 8 * GIB, limit: 8 * GIB, burst_fixed: "Slurm set this job's GPU shards when it was submitted" }));
    expect(slurm.elastic).toBeNull();
    expect(slurm.burstFixed).toBe("No burst: Slurm set this job's GPU shards when it was submitted.");
  });
});

describe('the enforcement line under device control', () => {
  it("names the kernel's device access where the broker runs device control, and only there", () => {
    const enforcement = { level: 'soft', mechanisms: ['framework-caps', 'watchdog'], description: 'PyTorch cap and NVML watchdog' };
    const guarded = view(status({ enforcement: { ...enforcement, device_access: "this kernel's GPU only" } }));
    expect(guarded.enforcement!.text).toBe("PyTorch cap and NVML watchdog; device access: this kernel's GPU only");
    expect(view(status({ enforcement })).enforcement!.text).toBe('PyTorch cap and NVML watchdog');
    expect(view(status({ enforcement: { ...enforcement, device_access: null } })).enforcement!.text).toBe(
      'PyTorch cap and NVML watchdog'
    );
  });
});
