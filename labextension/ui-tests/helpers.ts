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
