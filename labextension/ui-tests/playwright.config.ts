/**
 * Browser test of the GPU pool sidebar and status bar against a real JupyterLab on a
 * simulated pool. Start it with `bash ui-tests/run.sh` (starts and stops the server);
 * it needs GPUPOOL_UI_URL and GPUPOOL_UI_TOKEN when run by hand.
 *
 * Uses the system's Chromium (Debian `chromium`); no browser is ever downloaded.
 */
import { defineConfig } from '@playwright/test';

export default defineConfig({
  testDir: '.',
  testMatch: '*.spec.ts',
  outputDir: './test-results',
  timeout: 180 * 1000,
  expect: { timeout: 20 * 1000 },
  workers: 1,
  retries: 0,
  reporter: [['list']],
  use: {
    baseURL: process.env.GPUPOOL_UI_URL,
    viewport: { width: 1440, height: 900 },
    headless: true,
    trace: 'off',
    screenshot: 'only-on-failure',
    launchOptions: {
      executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    }
  }
});
