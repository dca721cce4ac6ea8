/**
 * Dates and times as the user reads them: `Intl.DateTimeFormat` in their locale (the browser's
 * when `locale` is not given), so a user in Berlin reads `Di., 1. Dez., 14:00–15:30 Uhr` and one in
 * New York `Tue, Dec 1, 02:00 – 03:30 PM`. Always in the browser's time zone.
 */

/** The hour and minute: `14:02` (en-GB), `02:02 PM` (en-US). */
export function clockTime(date: Date, locale?: string): string {
  return new Intl.DateTimeFormat(locale, { hour: '2-digit', minute: '2-digit' }).format(date);
}

/**
 * A span of time with its day: `Tue 1 Dec, 14:00–15:30` within a day and
 * `Tue 1 Dec, 22:00 – Wed 2 Dec, 02:00` across days (en-GB).
 */
export function dateTimeRange(from: Date, to: Date, locale?: string): string {
  return new Intl.DateTimeFormat(locale, {
    weekday: 'short',
    day: 'numeric',
    month: 'short',
    hour: '2-digit',
    minute: '2-digit'
  }).formatRange(from, to);
}
