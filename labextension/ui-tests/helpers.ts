/** Shared steps of the browser tests. */
import { APIRequestContext, expect, Page } from '@playwright/test';
import * as fs from 'fs';
import * as path from 'path';

export const TOKEN = process.env.GPUPOOL_UI_TOKEN ?? '';
export const SHOTS = path.resolve(
  process.env.GPUPOOL_UI_SCREENSHOTS || path.join(__dirname, 'screenshots')
);

declare global {
  interface Window {
    jupyterapp: any;
  }
}

/** Open JupyterLab with the token and wait until every plugin is activated and the layout restored. */
export async function openLab(page: Page): Promise<void> {
  expect(TOKEN, 'GPUPOOL_UI_TOKEN is set (run ui-tests/run.sh)').not.toBe('');
  fs.mkdirSync(SHOTS, { recursive: true });
  await page.goto(`lab?token=${TOKEN}`);
  await page.waitForFunction(() => !!window.jupyterapp?.restored, null, { timeout: 60 * 1000 });
  await page.evaluate(async () => {
    await window.jupyterapp.restored;
  });
  await expect(page.locator('#jp-main-statusbar')).toBeVisible();
}

/** Open a notebook (its kernel starts from the kernelspec) and wait until it is the current tab. */
export async function openNotebook(page: Page, notebook: string): Promise<void> {
  await page.evaluate(async p => {
    await window.jupyterapp.commands.execute('docmanager:open', { path: p });
  }, notebook);
  await expect(page.locator('#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current')).toContainText(notebook);
}

/**
 * Wait until the current notebook's kernel has started, is connected and idle, at most `timeout`
 * ms (a loaded machine can take tens of seconds to start a kernel). The pool's idle clock only
 * runs from the kernel's last message: while it starts and answers JupyterLab's first requests it
 * is active, and a countdown (a 3 s idle timeout in the idle and contrast suites) can only begin
 * once this holds. Returns the seconds waited.
 */
export async function kernelQuiet(page: Page, timeout = 180 * 1000): Promise<number> {
  const started = Date.now();
  await page.waitForFunction(
    () => {
      const kernel = window.jupyterapp?.shell?.currentWidget?.sessionContext?.session?.kernel;
      return !!kernel && kernel.connectionStatus === 'connected' && kernel.status === 'idle';
    },
    null,
    { timeout, polling: 100 }
  );
  return (Date.now() - started) / 1000;
}

/**
 * How long a countdown may take to show once the kernel is quiet: the idle timeout, a tick and
 * a refresh take seconds; the rest is headroom for a loaded machine (it is a deadline, not a
 * measure).
 */
export const COUNTDOWN_DEADLINE = 90 * 1000;

/** Save a screenshot of the page as SHOTS/name.png. */
export async function screenshot(page: Page, name: string): Promise<void> {
  const file = path.join(SHOTS, `${name}.png`);
  await page.screenshot({ path: file });
  console.log(`screenshot: ${file}`);
}

/** `GET` an API path of the server with the token. */
export function api(request: APIRequestContext, url: string) {
  return request.get(url, { headers: { Authorization: `token ${TOKEN}` } });
}

/** The kernel id of the session of `notebook`, once there is one. */
export async function kernelOf(request: APIRequestContext, notebook: string): Promise<string> {
  let id = '';
  await expect
    .poll(
      async () => {
        const sessions = (await (await api(request, 'api/sessions')).json()) as any[];
        id = sessions.find(s => s.path === notebook)?.kernel?.id ?? '';
        return id;
      },
      { message: `a kernel for ${notebook}` }
    )
    .not.toBe('');
  return id;
}
