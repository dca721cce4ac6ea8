/**
 * Counts, articles and sizes worded exactly as the server's `jupyter_gpupool/wording.py`
 * words them, so the sidebar, the status bar and the notifications say "1 request",
 * "2 requests", "an A100-80GB GPU" and "2 × 70 GiB" like the CLI and the magics
 * (labextension/test/parity.spec.ts compares the two).
 *
 * Pure functions: no JupyterLab imports (tested with jest).
 */
import { formatSize } from './units';

// Irregular plurals of nouns our messages count; every other noun takes "s".
const PLURALS: { [noun: string]: string } = {
  process: 'processes',
  this: 'these',
  is: 'are',
  was: 'were',
  has: 'have'
};
// Letters read with a vowel sound when spelt out (an H100, an L40S, an MI300X, an RTX 6000).
const VOWEL_SOUND_LETTERS = 'AEFHILMNORSX';
const CONSONANT_SOUND_WORDS = ['uni', 'use', 'usa', 'one', 'once', 'eu'];
const VOWEL_SOUND_WORDS = ['hour', 'honest'];

/** `noun` as it goes with `n`: `request` for 1, `requests` for 0, 2 or 1.5. */
export function plural(n: number, noun: string, many?: string): string {
  if (n === 1) {
    return noun;
  }
  return many || PLURALS[noun] || noun + 's';
}

/** `1 request`, `2 requests`, `0 GPUs`: the number with its noun agreeing. */
export function count(n: number, noun: string, many?: string): string {
  return `${n} ${plural(n, noun, many)}`;
}

/** `a` or `an` for `word` as it is read aloud: an A100, an H100, a GPU, an 80 GiB, a T4. */
export function article(word: string): string {
  const text = word.trim();
  if (!text) {
    return 'a';
  }
  const first = text[0];
  if (/\d/.test(first)) {
    const digits = (/^\d+/.exec(text) || [first])[0];
    const elevenOrEighteen =
      digits.length % 3 === 2 && ['11', '18'].includes(digits.slice(0, 2));
    return first === '8' || elevenOrEighteen ? 'an' : 'a';
  }
  const lower = text.toLowerCase();
  if (VOWEL_SOUND_WORDS.some(w => lower.startsWith(w))) {
    return 'an';
  }
  if (CONSONANT_SOUND_WORDS.some(w => lower.startsWith(w))) {
    return 'a';
  }
  const head = (/^[A-Za-z]+/.exec(text) || [first])[0];
  const upper = head === head.toUpperCase() && head !== head.toLowerCase();
  if (upper && (head.length <= 4 || /\d/.test(text))) {
    return VOWEL_SOUND_LETTERS.includes(first.toUpperCase()) ? 'an' : 'a';
  }
  return 'aeiou'.includes(first.toLowerCase()) ? 'an' : 'a';
}

/** `word` after its article: `an A100-80GB`, `a GPU`. */
export function withArticle(word: string): string {
  return `${article(word)} ${word}`;
}

/** A slice as it is held: `70 GiB` on one GPU, `2 × 70 GiB` across two. */
export function sliceSize(memoryPerGpu: number, numGpus: number): string {
  return numGpus <= 1
    ? formatSize(memoryPerGpu)
    : `${numGpus} × ${formatSize(memoryPerGpu)}`;
}

/**
 * A reclaim's recorded reason as the countdown before it says it: what is about to happen, not
 * what happened (`reclaimed: idle for 1 min while 1 request waited for a GPU` →
 * `idle for 1 min while 1 request waits for a GPU`).
 */
export function upcomingReclaim(reason: string): string {
  let text = reason.trim();
  for (const [done, ahead] of [
    ['reclaimed for ', 'for '],
    ['preempted for ', 'for '],
    ['reclaimed: ', '']
  ]) {
    if (text.startsWith(done)) {
      text = ahead + text.slice(done.length);
      break;
    }
  }
  text = text.replace(/\b(\d+|a|one) (request|job) waited\b/g, '$1 $2 waits');
  text = text.replace(/\b(\d+) (requests|jobs) waited\b/g, '$1 $2 wait');
  return text.replace(/ others waited/g, ' others wait');
}

/** `1st`, `2nd`, `3rd`, `4th`, `11th`, `22nd`. */
export function ordinal(n: number): string {
  const tens = n % 100;
  const suffix = tens >= 10 && tens <= 20 ? 'th' : ({ 1: 'st', 2: 'nd', 3: 'rd' } as Record<number, string>)[n % 10] || 'th';
  return `${n}${suffix}`;
}

/**
 * A kernel whose grow waits for room: `waiting to grow to 12 GiB since 14:02 (2nd in line)`
 * (`wanted`: bytes, all its GPUs; `since`: a clock time; `place`: 1-based, null if unknown).
 */
export function growWait(wanted: number, since: string, place: number | null = null): string {
  const where = place === null ? '' : place <= 1 ? ' (next in line)' : ` (${ordinal(place)} in line)`;
  return `waiting to grow to ${formatSize(wanted)} since ${since}${where}`;
}
