import {
  formatCountdown,
  formatDuration,
  formatGibHours,
  formatSize,
  formatSizePair,
  formatWait,
  GIB,
  InvalidInput,
  MIB,
  parseDuration,
  parseSize,
  PIB,
  SizeTooLarge,
  sizeArgument,
  TIB
} from '../src/units';

describe('parseSize', () => {
  it.each([
    ['8GiB', 8 * GIB],
    ['8G', 8 * GIB],
    ['8GB', 8 * GIB],
    ['8 gib', 8 * GIB],
    [' 12GiB ', 12 * GIB],
    ['512MiB', 512 * MIB],
    ['1.5GiB', 1.5 * GIB],
    ['1073741824', GIB]
  ])('%s → %d bytes', (text, bytes) => {
    expect(parseSize(text)).toBe(bytes);
  });

  it('takes a percentage of the GPU', () => {
    expect(parseSize('25%', 16 * GIB)).toBe(4 * GIB);
    expect(parseSize('100%', 16 * GIB)).toBe(16 * GIB);
  });

  it('refuses a percentage without a GPU, or out of range', () => {
    expect(() => parseSize('25%')).toThrow('a percentage needs a GPU');
    expect(() => parseSize('0%', GIB)).toThrow('above 0% and at most 100%');
    expect(() => parseSize('101%', GIB)).toThrow('above 0% and at most 100%');
  });

  it.each(['', 'lots', '-1GiB', '1e9', '8,5G', '0'])(
    'refuses %j naming the accepted forms',
    text => {
      let error: unknown;
      try {
        parseSize(text);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(InvalidInput);
      expect((error as Error).message).toMatch(/^invalid size '.*': /);
      expect((error as Error).message).toContain('8GiB, 8G, 8GB, 512MiB');
      expect((error as Error).message).not.toContain('\n');
    }
  );

  it('names the unknown unit, and the units there are', () => {
    expect(() => parseSize('8GiBs')).toThrow("unknown unit 'GiBs'");
    expect(() => parseSize('8 XB')).toThrow(
      "unknown unit 'XB'; units are B, KiB, MiB, GiB, TiB, PiB, EiB"
    );
  });

  it('knows every unit up to EiB and reads each as binary', () => {
    expect(parseSize('1PB')).toBe(PIB);
    expect(parseSize('1P')).toBe(PIB);
    expect(parseSize('0.5PiB')).toBe(PIB / 2);
    expect(parseSize('2TB')).toBe(2 * TIB);
  });

  it.each(['1025TiB', '4PB', '2PiB', '1EB', '3EiB', '1e'])(
    'refuses %j as too large, not as an unknown unit',
    text => {
      let error: unknown;
      try {
        parseSize(text);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(SizeTooLarge);
      expect((error as Error).message).toBe(
        `invalid size '${text}': too large: no GPU pool holds more than 1 PiB; expected at most 1PiB`
      );
    }
  );

  it('refuses zero', () => {
    expect(() => parseSize('0')).toThrow('a size must be at least 1 byte');
  });
});

describe('parseDuration', () => {
  it.each([
    ['90s', 90],
    ['30m', 1800],
    ['2h', 7200],
    ['1h30m', 5400],
    ['1h 30m', 5400],
    ['1d', 86400],
    ['3600', 3600],
    ['30min', 1800],
    ['90sec', 90],
    ['1.5h', 5400],
    ['2H', 7200]
  ])('%s → %d s', (text, seconds) => {
    expect(parseDuration(text)).toBe(seconds);
  });

  it.each(['', 'soon', '2x', '1h30', 'h', '2ms', '-5m', '0', '0s', '367d'])(
    'refuses %j naming the accepted forms',
    text => {
      expect(() => parseDuration(text)).toThrow(InvalidInput);
      expect(() => parseDuration(text)).toThrow('90s, 30m, 2h, 1h30m');
    }
  );
});

describe('formatSize', () => {
  it.each([
    [8 * GIB, '8 GiB'],
    [3.1 * GIB, '3.1 GiB'],
    [3.04 * GIB, '3 GiB'],
    [512 * MIB, '512 MiB'],
    [1536, '1.5 KiB'],
    [100, '100 B'],
    [0, '0 B'],
    [80 * GIB, '80 GiB'],
    [2048 * GIB, '2 TiB']
  ])('%d → %s', (bytes, text) => {
    expect(formatSize(bytes)).toBe(text);
  });

  it('says unknown for missing values', () => {
    expect(formatSize(null)).toBe('unknown');
    expect(formatSize(undefined)).toBe('unknown');
  });

  it('formats a part against its whole in the whole’s unit', () => {
    expect(formatSizePair(3.1 * GIB, 8 * GIB)).toBe('3.1 / 8 GiB');
    expect(formatSizePair(300 * MIB, 8 * GIB)).toBe('0.3 / 8 GiB');
    expect(formatSizePair(0, 8 * GIB)).toBe('0 / 8 GiB');
    expect(formatSizePair(null, 8 * GIB)).toBe('– / 8 GiB');
  });

  it('writes sizes back in a form the server accepts', () => {
    expect(sizeArgument(3 * GIB)).toBe('3GiB');
    expect(sizeArgument(1536 * MIB)).toBe('1536MiB');
    expect(parseSize(sizeArgument(1536 * MIB))).toBe(1536 * MIB);
  });
});

describe('durations for people', () => {
  it.each([
    [0, '0 s'],
    [59, '59 s'],
    [270, '4 min 30 s'],
    [600, '10 min'],
    [630, '10 min'],
    [3600, '1 h'],
    [5400, '1 h 30 min'],
    [3 * 86400 + 3600, '3 d 1 h'],
    [-5, '0 s']
  ])('formatDuration(%d) = %s', (seconds, text) => {
    expect(formatDuration(seconds)).toBe(text);
  });

  it('counts down like a clock', () => {
    expect(formatCountdown(272)).toBe('4:32');
    expect(formatCountdown(59.2)).toBe('1:00');
    expect(formatCountdown(3725)).toBe('1:02:05');
    expect(formatCountdown(-3)).toBe('0:00');
  });

  it('rounds waits', () => {
    expect(formatWait(null)).toBe('unknown');
    expect(formatWait(20)).toBe('under a minute');
    expect(formatWait(240)).toBe('about 4 min');
    expect(formatWait(2 * 3600 + 100)).toBe('about 2 h');
  });

  it('formats GiB-hours', () => {
    expect(formatGibHours(1.234)).toBe('1.2 GiB·h');
    expect(formatGibHours(123.4)).toBe('123 GiB·h');
    expect(formatGibHours(undefined)).toBe('unknown');
  });
});
