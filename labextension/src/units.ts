/**
 * Sizes and durations as users type them, parsed and formatted exactly like the
 * server's `jupyter_gpupool/units.py`, so a value the form accepts is a value the
 * server accepts, and numbers read the same in the sidebar, the CLI and the magics.
 *
 * Pure functions: no JupyterLab imports (tested with jest).
 */

export const KIB = 1024;
export const MIB = 1024 ** 2;
export const GIB = 1024 ** 3;
export const TIB = 1024 ** 4;
export const PIB = 1024 ** 5;
export const EIB = 1024 ** 6;

/** The accepted size forms, worded as the server words them. */
export const SIZE_FORMS =
  'a size like 8GiB, 8G, 8GB, 512MiB, 1073741824 (bytes) or 25% (of a GPU)';
/** The accepted duration forms, worded as the server words them. */
export const DURATION_FORMS =
  'a duration like 90s, 30m, 2h, 1h30m, 1d or 3600 (seconds)';

/** The units a size may carry, as an error names them. */
export const SIZE_UNITS_NAMED =
  'B, KiB, MiB, GiB, TiB, PiB, EiB, as in 8GiB (K/KB, M/MB, G/GB, T/TB, P/PB, E/EB are the same binary units)';

/** Largest size accepted: bigger numbers are typos. */
export const MAX_SIZE = PIB;
/** What a size over {@link MAX_SIZE} is told, wherever it is typed. */
export const TOO_LARGE = 'too large: no GPU pool holds more than 1 PiB; expected at most 1PiB';
/** Longest duration accepted (366 days). */
export const MAX_DURATION = 366 * 86400;

// Binary units on purpose: GPU memory is sold in GiB even when labelled "GB". Every prefix up
// to exa is known, so a size too large for any GPU says so rather than "unknown unit".
const SIZE_UNITS: { [unit: string]: number } = { '': 1, b: 1 };
Array.from('kmgtpe').forEach((letter, i) => {
  const factor = 1024 ** (i + 1);
  SIZE_UNITS[letter] = factor;
  SIZE_UNITS[letter + 'b'] = factor;
  SIZE_UNITS[letter + 'ib'] = factor;
});
const SIZE_RE = /^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$/;
const PERCENT_RE = /^\s*(\d+(?:\.\d+)?)\s*%\s*$/;

const DURATION_UNITS: { [unit: string]: number } = {
  s: 1,
  sec: 1,
  m: 60,
  min: 60,
  h: 3600,
  d: 86400
};
const DURATION_PART = /(\d+(?:\.\d+)?)\s*(d|h|min|m|sec|s)/gi;
const PLAIN_NUMBER = /^\d+(?:\.\d+)?$/;

/** A value the user typed that the pool would refuse; `message` is one line. */
export class InvalidInput extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'InvalidInput';
  }
}

/** A size beyond what any pool holds (the server answers it with 409, as a request too large). */
export class SizeTooLarge extends InvalidInput {
  constructor(message: string) {
    super(message);
    this.name = 'SizeTooLarge';
  }
}

/** Python's `repr` of a string, for messages identical to the server's. */
function quote(text: string): string {
  return text.includes("'") && !text.includes('"')
    ? `"${text}"`
    : `'${text.replace(/\\/g, '\\\\').replace(/'/g, "\\'")}'`;
}

/**
 * Return a positive whole number of bytes from `text`.
 *
 * `25%` is a share of `gpuMemory` (the GPU the request is for, or the largest GPU).
 * Throws {@link InvalidInput} naming the accepted forms.
 */
export function parseSize(text: string, gpuMemory?: number | null): number {
  const raw = String(text);
  const percent = PERCENT_RE.exec(raw);
  if (percent) {
    const share = parseFloat(percent[1]);
    if (!(share > 0 && share <= 100)) {
      throw new InvalidInput(
        `invalid size ${quote(raw)}: a percentage must be above 0% and at most 100%`
      );
    }
    if (gpuMemory === undefined || gpuMemory === null) {
      throw new InvalidInput(
        `invalid size ${quote(raw)}: a percentage needs a GPU to take it of`
      );
    }
    return Math.max(1, Math.floor((gpuMemory * share) / 100));
  }
  const match = SIZE_RE.exec(raw);
  if (!match) {
    throw new InvalidInput(`invalid size ${quote(raw)}: expected ${SIZE_FORMS}`);
  }
  const unit = match[2].toLowerCase();
  if (!(unit in SIZE_UNITS)) {
    throw new InvalidInput(
      `invalid size ${quote(raw)}: unknown unit ${quote(match[2])}; units are ${SIZE_UNITS_NAMED}`
    );
  }
  const value = parseFloat(match[1]) * SIZE_UNITS[unit];
  if (!isFinite(value) || value > MAX_SIZE) {
    throw new SizeTooLarge(`invalid size ${quote(raw)}: ${TOO_LARGE}`);
  }
  if (value < 1) {
    throw new InvalidInput(
      `invalid size ${quote(raw)}: a size must be at least 1 byte; expected ${SIZE_FORMS}`
    );
  }
  return Math.floor(value);
}

/** Return a positive number of seconds from `text` (`2h`, `1h30m`, `90`). */
export function parseDuration(text: string): number {
  const raw = String(text).trim();
  let seconds: number;
  if (PLAIN_NUMBER.test(raw)) {
    seconds = parseFloat(raw);
  } else {
    const compact = raw.replace(/ /g, '');
    const parts = Array.from(compact.matchAll(DURATION_PART));
    const joined = parts.map(p => p[1] + p[2]).join('');
    if (parts.length === 0 || joined.toLowerCase() !== compact.toLowerCase()) {
      throw new InvalidInput(
        `invalid duration ${quote(String(text))}: expected ${DURATION_FORMS}`
      );
    }
    seconds = parts.reduce(
      (sum, p) => sum + parseFloat(p[1]) * DURATION_UNITS[p[2].toLowerCase()],
      0
    );
  }
  if (!isFinite(seconds) || seconds <= 0 || seconds > MAX_DURATION) {
    throw new InvalidInput(
      `invalid duration ${quote(String(text))}: must be above 0 and at most 366 days; expected ${DURATION_FORMS}`
    );
  }
  return seconds;
}

/** Python's `f"{x:.1f}".rstrip("0").rstrip(".")`. */
function oneDecimal(value: number): string {
  let text = value.toFixed(1);
  if (text.includes('.')) {
    text = text.replace(/0+$/, '').replace(/\.$/, '');
  }
  return text === '-0' ? '0' : text;
}

const SIZE_STEPS: [string, number][] = [
  ['EiB', EIB],
  ['PiB', PIB],
  ['TiB', TIB],
  ['GiB', GIB],
  ['MiB', MIB],
  ['KiB', KIB]
];

/** The unit `formatSize` picks for `numBytes`, and its factor. */
export function sizeUnit(numBytes: number): [string, number] {
  for (const [unit, factor] of SIZE_STEPS) {
    if (Math.abs(numBytes) >= factor) {
      return [unit, factor];
    }
  }
  return ['B', 1];
}

/** `8589934592` → `8 GiB`; `3.1 GiB` keeps one decimal when it matters. */
export function formatSize(numBytes: number | null | undefined): string {
  if (numBytes === null || numBytes === undefined || !isFinite(numBytes)) {
    return 'unknown';
  }
  const [unit, factor] = sizeUnit(numBytes);
  if (unit === 'B') {
    return `${Math.trunc(numBytes)} B`;
  }
  return `${oneDecimal(numBytes / factor)} ${unit}`;
}

/**
 * Two sizes in the unit of the second: `(3.3e9, 8 GiB)` → `3.1 / 8 GiB`.
 * Used where a part is read against its whole (status bar, bars).
 */
export function formatSizePair(
  part: number | null | undefined,
  whole: number
): string {
  const [unit, factor] = sizeUnit(whole);
  const wholeText =
    unit === 'B' ? `${Math.trunc(whole)}` : oneDecimal(whole / factor);
  const partText =
    part === null || part === undefined || !isFinite(part)
      ? '–'
      : unit === 'B'
        ? `${Math.trunc(part)}`
        : oneDecimal(part / factor);
  return `${partText} / ${wholeText} ${unit}`;
}

/** A size as the server accepts it back (`3GiB`, `512MiB`), whole numbers only. */
export function sizeArgument(numBytes: number): string {
  if (numBytes % GIB === 0) {
    return `${numBytes / GIB}GiB`;
  }
  if (numBytes % MIB === 0) {
    return `${numBytes / MIB}MiB`;
  }
  return `${Math.round(numBytes)}`;
}

/** Python's `round` (banker's rounding), so durations read like the server's. */
function pyRound(value: number): number {
  const floor = Math.floor(value);
  const diff = value - floor;
  if (diff > 0.5) {
    return floor + 1;
  }
  if (diff < 0.5) {
    return floor;
  }
  return floor % 2 === 0 ? floor : floor + 1;
}

/** `270` → `4 min 30 s`; `null` → `unknown`. */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return 'unknown';
  }
  const total = Math.max(0, pyRound(seconds));
  if (total < 60) {
    return `${total} s`;
  }
  let minutes = Math.floor(total / 60);
  const sec = total % 60;
  if (minutes < 60) {
    return `${minutes} min` + (sec && minutes < 10 ? ` ${sec} s` : '');
  }
  let hours = Math.floor(minutes / 60);
  minutes = minutes % 60;
  if (hours < 48) {
    return `${hours} h` + (minutes ? ` ${minutes} min` : '');
  }
  const days = Math.floor(hours / 24);
  hours = hours % 24;
  return `${days} d` + (hours ? ` ${hours} h` : '');
}

/** A clock-style countdown: `272` → `4:32`, `3725` → `1:02:05`, never negative. */
export function formatCountdown(seconds: number): string {
  const total = Math.max(0, Math.ceil(seconds));
  const h = Math.floor(total / 3600);
  const m = Math.floor((total % 3600) / 60);
  const s = total % 60;
  const ss = String(s).padStart(2, '0');
  if (h > 0) {
    return `${h}:${String(m).padStart(2, '0')}:${ss}`;
  }
  return `${m}:${ss}`;
}

/** An approximate wait for people: `about 4 min`, `under a minute`, `unknown`. */
export function formatWait(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return 'unknown';
  }
  if (seconds < 60) {
    return 'under a minute';
  }
  if (seconds < 3600) {
    return `about ${Math.round(seconds / 60)} min`;
  }
  return `about ${formatDuration(Math.round(seconds / 600) * 600)}`;
}

/** `1.234` GiB·hours → `1.2 GiB·h`. */
export function formatGibHours(value: number | null | undefined): string {
  if (value === null || value === undefined || !isFinite(value)) {
    return 'unknown';
  }
  return `${value < 10 ? value.toFixed(1) : Math.round(value)} GiB·h`;
}

/**
 * Time left as a person reads it: from 10 min on, to the nearest minute, so the moment it took
 * to answer does not turn "1 h" into "59 min"; below, to the second, rounded up
 * (`remaining` in jupyter_gpupool/wording.py).
 */
export function formatRemaining(seconds: number): string {
  const left = Math.max(0, seconds);
  return formatDuration(left >= 600 ? pyRound(left / 60) * 60 : Math.ceil(left));
}
