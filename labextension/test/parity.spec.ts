/**
 * The form accepts exactly what the server accepts, and formats numbers as the server
 * does: run the same inputs through jupyter_gpupool/units.py and through units.ts.
 */
import { execFileSync } from 'child_process';
import * as path from 'path';

import { formatDuration, formatRemaining, formatSize, parseDuration, parseSize } from '../src/units';
import { article, count, growWait, ordinal, sliceSize, upcomingReclaim } from '../src/wording';
import { elasticLine, rightSizeHint } from '../src/view';

const REPO = path.resolve(__dirname, '..', '..');
const PYTHON = process.env.PYTHON || 'python3';

const SIZES = ['8GiB', '8G', '8GB', '512MiB', '25%', '1.5g', '12 GiB', '0', '8XB', 'x', '100%', '101%', '1073741824', '1024TiB', '1025TiB', '3.7kb', ' 7 t ',
  '1PB', '1P', '0.5PiB', '4PB', '2EiB', '1e', '0.5b'];
const DURATIONS = ['90s', '30m', '2h', '1h30m', '1h 30m', '1d', '3600', '2ms', '1h30', '30min', '90sec', '0', '367d', '1.5h', 'soon', '2H'];
const NUMBERS = [0, 1, 100, 1023, 1024, 1536, 3.1 * 1024 ** 3, 8 * 1024 ** 3, 80 * 1024 ** 3, 1.05 * 1024 ** 4, 123456789, 1024 ** 5, 3 * 1024 ** 6];
/** Words the messages put an article before, counts of nouns, slices and reclaim reasons. */
const WORDS = ['A100-80GB', 'H100', 'GPU', 'T4', 'L40S', 'RTX 6000', 'MI300X', 'V100', 'user', 'idle', 'hour', '80 GiB', '8 GiB', '18 GiB', '11 GiB', '110 GiB', '1 GiB', 'unit', 'A10G', 'Quadro'];
const COUNTS: Array<[number, string]> = [[0, 'request'], [1, 'request'], [2, 'request'], [1, 'GPU'], [4, 'GPU'], [2, 'process'], [1.5, 'hour']];
const SLICES: Array<[number, number]> = [[70 * 1024 ** 3, 2], [8 * 1024 ** 3, 1], [3.5 * 1024 ** 3, 4]];
const REASONS = [
  'reclaimed: idle for 1 min while 1 request waited for a GPU',
  'reclaimed: idle for 31 min while 2 requests waited for a GPU',
  'reclaimed: idle for 31 min, over the 30 min idle timeout',
  'reclaimed for the reservation lab: idle for 5 min',
  'preempted for a higher priority (8 GiB for bob)',
  'reclaimed: idle for 2 min while 3 jobs waited in partition gpu'
];
const LEFT = [0.2, 59.2, 61, 599.5, 600, 3540.5, 3599.2, 86399];
const GB = 1024 ** 3;
/** (slice, peak) pairs for the right-sizing hint, around each edge of the rule. */
const HINTS: Array<[number, number | null]> = [
  [8 * GB, 2.1 * GB], [8 * GB, 300 * 1024 ** 2], [8 * GB, 5 * GB], [8 * GB, 3.5 * GB], [8 * GB, 3.2 * GB],
  [1.5 * GB, 0.1 * GB], [8 * GB, null], [8 * GB, 0], [80 * GB, 0.5 * GB], [2 * GB, 0.5 * GB], [3 * GB, 0.7 * GB],
  [1.05 * 1024 ** 4, 3.3 * GB], [16 * GB, 6.4 * GB]
];
/** Elastic slices (GiB per GPU): guarantee, current size, the limit it asked for (0: fixed), GPUs. */
const ELASTIC: Array<[number, number, number, number]> = [
  [4, 9.2, 40, 1], [4, 4, 40, 1], [2, 6.5, 16, 1], [0.5, 0.5, 2, 1], [4, 4, 0, 1], [8, 8, 8, 1], [4, 6, 8, 2], [2, 16, 16, 1]
];
/** Grows that wait (bytes wanted, clock, place in line or null). */
const GROW_WAITS: Array<[number, string, number | null]> = [
  [12 * 1024 ** 3, '14:02', 2], [12 * 1024 ** 3, '14:02', 1], [24 * 1024 ** 3, '09:30', null], [9.5 * 1024 ** 3, '23:59', 3],
  [40 * 1024 ** 3, '00:00', 11], [40 * 1024 ** 3, '00:00', 22], [40 * 1024 ** 3, '00:00', 113]
];
const SECONDS = [0, 1, 59, 60, 61, 270, 599, 600, 630, 3599, 3600, 5400, 86399, 172800, 3 * 86400 + 3600, 2.5];

const SCRIPT = `
import json, sys
from jupyter_gpupool.units import parse_size, parse_duration, format_size, format_duration
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.kernel.status import right_size_hint
from jupyter_gpupool.wording import article, count, grow_wait, remaining, slice_size, upcoming_reclaim
from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.rest.views import elastic_fields, elastic_line
def elastic(g, m, limit, gpus):
    lease = Lease(id="l", owner="u", memory=int(m * 1024**3), guarantee=int(g * 1024**3), burst_limit=int(limit * 1024**3), num_gpus=gpus, state=LeaseState.GRANTED, created_at=0.0)
    return {"fields": {**elastic_fields(lease), "memory": lease.memory, "num_gpus": gpus}, "line": elastic_line(lease)}
data = json.load(sys.stdin)
def run(fn, *a, **kw):
    try:
        return {"ok": fn(*a, **kw)}
    except InvalidInput as e:
        return {"error": str(e)}
print(json.dumps({
    "sizes": [run(parse_size, s, gpu_memory=16 * 1024**3) for s in data["sizes"]],
    "durations": [run(parse_duration, s) for s in data["durations"]],
    "formatted": [format_size(n) for n in data["numbers"]],
    "durations_formatted": [format_duration(n) for n in data["seconds"]],
    "hints": [h and {"text": h.text, "memory": h.memory, "button": h.button} for h in (right_size_hint(m, p) for m, p in data["hints"])],
    "articles": [article(w) for w in data["words"]],
    "counts": [count(n, noun) for n, noun in data["counts"]],
    "slices": [slice_size(int(m), g) for m, g in data["slices"]],
    "reasons": [upcoming_reclaim(r) for r in data["reasons"]],
    "remaining": [remaining(s) for s in data["left"]],
    "elastic": [elastic(*e) for e in data["elastic"]],
    "grow_waits": [grow_wait(int(w), c, p) for w, c, p in data["grow_waits"]],
}))
`;

function python(): any {
  const out = execFileSync(PYTHON, ['-c', SCRIPT], {
    cwd: REPO,
    env: { ...process.env, PYTHONPATH: REPO },
    input: JSON.stringify({
      sizes: SIZES, durations: DURATIONS, numbers: NUMBERS, seconds: SECONDS, hints: HINTS,
      words: WORDS, counts: COUNTS, slices: SLICES, reasons: REASONS, left: LEFT, elastic: ELASTIC,
      grow_waits: GROW_WAITS
    })
  });
  return JSON.parse(out.toString());
}

function ts(fn: () => number): { ok?: number; error?: string } {
  try {
    return { ok: fn() };
  } catch (e) {
    return { error: (e as Error).message };
  }
}

describe('parity with jupyter_gpupool/units.py', () => {
  const expected = python();

  it('accepts and refuses the same sizes, with the same messages', () => {
    expect(SIZES.map(s => ts(() => parseSize(s, 16 * 1024 ** 3)))).toEqual(expected.sizes);
  });

  it('accepts and refuses the same durations, with the same messages', () => {
    expect(DURATIONS.map(s => ts(() => parseDuration(s)))).toEqual(expected.durations);
  });

  it('gives the same right-sizing hint as %gpupool status and the widget', () => {
    expect(HINTS.map(([memory, peak]) => rightSizeHint(memory, peak))).toEqual(expected.hints);
  });

  it('formats sizes and durations the same', () => {
    expect(NUMBERS.map(formatSize)).toEqual(expected.formatted);
    expect(SECONDS.map(formatDuration)).toEqual(expected.durations_formatted);
  });

  it('words counts, articles, slices, reclaim countdowns and time left the same', () => {
    expect(WORDS.map(article)).toEqual(expected.articles);
    expect(COUNTS.map(([n, noun]) => count(n, noun))).toEqual(expected.counts);
    expect(SLICES.map(([m, g]) => sliceSize(m, g))).toEqual(expected.slices);
    expect(REASONS.map(upcomingReclaim)).toEqual(expected.reasons);
    expect(LEFT.map(formatRemaining)).toEqual(expected.remaining);
  });

  it("words an elastic slice's line as %gpupool status does, from the REST fields", () => {
    const lines = (expected.elastic as Array<{ fields: any; line: string }>).map(e => elasticLine(e.fields));
    expect(lines).toEqual(expected.elastic.map((e: { line: string }) => e.line));
    expect(lines[0]).toBe('4 GiB guaranteed · 9.2 GiB now, up to 40 GiB');
  });

  it('words a grow that waits in line as %gpupool status does', () => {
    expect(GROW_WAITS.map(([w, c, p]) => growWait(w, c, p))).toEqual(expected.grow_waits);
    expect(expected.grow_waits[0]).toBe('waiting to grow to 12 GiB since 14:02 (2nd in line)');
    expect([11, 22, 113].map(ordinal)).toEqual(['11th', '22nd', '113th']);
  });
});
