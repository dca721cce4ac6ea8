/**
 * Every line of the GPU pool sidebar is readable: in JupyterLab's light and dark themes, each
 * piece of text meets WCAG AA contrast against what is really behind it (4.5:1, or 3:1 for large
 * text), computed from the page's computed styles, and none is smaller than 12 px. The sidebar
 * shows a granted slice counting down to an idle reclaim, so its captions, meters, enforcement
 * line, countdown and buttons are all on screen. Run by `bash ui-tests/run.sh contrast`.
 */
import { expect, Page, test } from '@playwright/test';

import { COUNTDOWN_DEADLINE, kernelQuiet, openLab, openNotebook, screenshot } from './helpers';

/** WCAG 2 AA: body text, and large text (24 px, or 18.66 px bold). */
const BODY_RATIO = 4.5;
const LARGE_RATIO = 3;
/** Smallest text the sidebar may show. */
const MIN_FONT_PX = 12;

interface ITextSample {
  text: string;
  classes: string;
  ratio: number;
  fontPx: number;
  large: boolean;
}

/** Every visible text of the panel, with its contrast ratio against its effective background. */
async function textSamples(page: Page): Promise<ITextSample[]> {
  return page.evaluate(() => {
    type RGBA = [number, number, number, number];
    const parse = (css: string): RGBA => {
      // rgb(a) in 0-255, or color(srgb r g b / a) in 0-1 (what color-mix() computes to).
      const srgb = /color\(srgb\s+([\d.e-]+)\s+([\d.e-]+)\s+([\d.e-]+)(?:\s*\/\s*([\d.e-]+))?\)/.exec(css);
      if (srgb) {
        return [+srgb[1] * 255, +srgb[2] * 255, +srgb[3] * 255, srgb[4] === undefined ? 1 : +srgb[4]];
      }
      const rgb = /rgba?\(([^)]+)\)/.exec(css);
      if (!rgb) {
        return [0, 0, 0, 0];
      }
      const parts = rgb[1].split(/[\s,/]+/).filter(Boolean).map(Number);
      return [parts[0], parts[1], parts[2], parts.length > 3 ? parts[3] : 1];
    };
    const over = (top: RGBA, under: RGBA): RGBA => [
      top[0] * top[3] + under[0] * (1 - top[3]),
      top[1] * top[3] + under[1] * (1 - top[3]),
      top[2] * top[3] + under[2] * (1 - top[3]),
      1
    ];
    const backgroundOf = (element: Element): RGBA => {
      const layers: RGBA[] = [];
      for (let e: Element | null = element; e; e = e.parentElement) {
        const layer = parse(getComputedStyle(e).backgroundColor);
        if (layer[3] > 0) {
          layers.push(layer);
          if (layer[3] >= 1) {
            break;
          }
        }
      }
      let color: RGBA = [255, 255, 255, 1]; // the canvas, if nothing paints
      for (const layer of layers.reverse()) {
        color = over(layer, color);
      }
      return color;
    };
    const luminance = (c: RGBA): number => {
      const [r, g, b] = c.slice(0, 3).map(v => {
        const s = v / 255;
        return s <= 0.03928 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
      });
      return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const opacityOf = (element: Element): number => {
      let opacity = 1;
      for (let e: Element | null = element; e; e = e.parentElement) {
        opacity *= Number(getComputedStyle(e).opacity);
      }
      return opacity;
    };
    const panel = document.querySelector('#jupyter-gpupool-panel');
    const samples: ITextSample[] = [];
    if (!panel) {
      return samples;
    }
    for (const element of Array.from(panel.querySelectorAll('*'))) {
      const own = Array.from(element.childNodes)
        .filter(n => n.nodeType === Node.TEXT_NODE)
        .map(n => n.textContent ?? '')
        .join('')
        .trim();
      const style = getComputedStyle(element);
      if (!own || !element.getClientRects().length || style.visibility === 'hidden') {
        continue;
      }
      // WCAG exempts inactive controls: a disabled button may be dimmed.
      if (element.closest('[disabled], [aria-disabled="true"]')) {
        continue;
      }
      const background = backgroundOf(element);
      const color = parse(style.color);
      const foreground = over([color[0], color[1], color[2], color[3] * opacityOf(element)], background);
      const [lighter, darker] = [luminance(foreground), luminance(background)].sort((a, b) => b - a);
      const fontPx = parseFloat(style.fontSize);
      const bold = Number(style.fontWeight) >= 700;
      samples.push({
        text: own.slice(0, 60),
        classes: String(element.className),
        ratio: (lighter + 0.05) / (darker + 0.05),
        fontPx,
        large: fontPx >= 24 || (bold && fontPx >= 18.66)
      });
    }
    return samples;
  });
}

async function useTheme(page: Page, theme: string): Promise<void> {
  await page.evaluate(async name => {
    await window.jupyterapp.commands.execute('apputils:change-theme', { theme: name });
  }, theme);
  await expect.poll(() => page.evaluate(() => document.body.dataset.jpThemeName)).toBe(theme);
  // The theme's stylesheet is in once its variables apply.
  const light = theme.includes('Light');
  await expect
    .poll(() => page.evaluate(() => document.body.dataset.jpThemeLight))
    .toBe(light ? 'true' : 'false');
  await page.waitForTimeout(500);
}

test('the sidebar text meets WCAG AA contrast in the light and dark themes', async ({ page }) => {
  await openLab(page);
  await openNotebook(page, 'a.ipynb');
  const status = page.locator('.jp-GpuPool-status');
  await expect(status).toHaveText(/^GPU (–|[\d.]+) \/ 8 GiB/);
  await status.click();
  const panel = page.locator('#jupyter-gpupool-panel');
  await expect(panel).toBeVisible();
  // Idle: the countdown (its reason in a caption) and Keep are on screen too. The pool's idle
  // clock starts at the kernel's last message, so first the kernel must have started and gone
  // quiet (slow on a loaded machine), then the countdown follows within seconds.
  const quietAfter = await kernelQuiet(page);
  const quiet = Date.now();
  await expect(panel.locator('.jp-GpuPool-idle')).toBeVisible({ timeout: COUNTDOWN_DEADLINE });
  console.log(`kernel quiet after ${quietAfter.toFixed(1)} s; countdown ${((Date.now() - quiet) / 1000).toFixed(1)} s later`);
  await expect(panel.locator('.jp-GpuPool-enforcement')).toBeVisible();

  const problems: string[] = [];
  for (const theme of ['JupyterLab Light', 'JupyterLab Dark']) {
    await useTheme(page, theme);
    await screenshot(page, `contrast-${theme.split(' ')[1].toLowerCase()}`);
    const samples = await textSamples(page);
    expect(samples.length, 'the panel shows text').toBeGreaterThan(10);
    const report = samples.map(s => `${s.ratio.toFixed(2)}:1 ${s.fontPx}px ${s.classes} "${s.text}"`);
    console.log(`${theme}:\n  ${report.join('\n  ')}`);
    for (const s of samples) {
      if (s.ratio < (s.large ? LARGE_RATIO : BODY_RATIO)) {
        problems.push(`${theme}: contrast ${s.ratio.toFixed(2)}:1 (${s.classes}) "${s.text}"`);
      }
      if (s.fontPx < MIN_FONT_PX) {
        problems.push(`${theme}: ${s.fontPx}px, under ${MIN_FONT_PX}px (${s.classes}) "${s.text}"`);
      }
    }
  }
  expect(problems, 'every text of the sidebar meets WCAG AA and is at least 12 px').toEqual([]);

  // The enforcement line is one short sentence, not a paragraph.
  const enforcement = (await panel.locator('.jp-GpuPool-enforcement').innerText()).trim();
  expect(enforcement.length, enforcement).toBeLessThanOrEqual(110);
});
