/**
 * Client of the jupyter_gpupool REST API (`/api/gpupool/...`), through
 * `ServerConnection.makeRequest` so it shares JupyterLab's token, XSRF and base URL.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import {
  errorMessage,
  GpuPoolRequestError,
  IKernelStatus,
  IPoolSnapshot
} from './types';

/** A reply and the server clock it came with (epoch s, from the Date header). */
export interface ITimed<T> {
  data: T;
  serverTime: number | null;
}

/** Thin client of the REST API, sharing JupyterLab's server settings (token, XSRF, base URL). */
export class GpuPoolClient {
  constructor(readonly serverSettings: ServerConnection.ISettings) {}

  /** `GET /api/gpupool/pool`. */
  pool(): Promise<ITimed<IPoolSnapshot>> {
    return this._request<IPoolSnapshot>('pool');
  }

  /** `GET /api/gpupool/kernels/{id}`. */
  kernel(kernelId: string): Promise<ITimed<IKernelStatus>> {
    return this._request<IKernelStatus>(
      `kernels/${encodeURIComponent(kernelId)}`
    );
  }

  /** Grow, shrink, or hold through idle for a time: `{"memory": "12GiB", "duration": "2h"}`. */
  async reserve(
    kernelId: string,
    body: { memory?: string; duration?: string }
  ): Promise<IKernelStatus | null> {
    const reply = await this._request<IKernelStatus | null>(
      `kernels/${encodeURIComponent(kernelId)}/reserve`,
      { method: 'POST', body: JSON.stringify(body) }
    );
    return reply.data;
  }

  /** Give the kernel's slice back to the pool. */
  async release(kernelId: string): Promise<IKernelStatus | null> {
    const reply = await this._request<IKernelStatus | null>(
      `kernels/${encodeURIComponent(kernelId)}/release`,
      { method: 'POST', body: '{}' }
    );
    return reply.data;
  }

  /** Hold the slice through idle for `duration` (`1h`). */
  async keepalive(
    kernelId: string,
    duration: string
  ): Promise<IKernelStatus | null> {
    const reply = await this._request<IKernelStatus | null>(
      `kernels/${encodeURIComponent(kernelId)}/keepalive`,
      { method: 'POST', body: JSON.stringify({ duration }) }
    );
    return reply.data;
  }

  /**
   * Park the kernel's GPU memory in host RAM now (`POST .../suspend`); it resumes on its next
   * cell. A refusal (409: no checkpoint support, the parked-memory budget is full) throws with
   * the server's one-line reason.
   */
  async suspendKernel(kernelId: string): Promise<IKernelStatus | null> {
    const reply = await this._request<IKernelStatus | null>(
      `kernels/${encodeURIComponent(kernelId)}/suspend`,
      { method: 'POST', body: '{}' }
    );
    return reply.data;
  }

  /**
   * Bring a suspended kernel back (`POST .../resume`): it queues for a GPU by policy. `ahead`:
   * before any cell needs it (its notebook got focus, a cell was edited); such a resume queues
   * behind every real request and takes no GPU from anyone.
   */
  async resumeKernel(kernelId: string, ahead = false): Promise<IKernelStatus | null> {
    const reply = await this._request<IKernelStatus | null>(
      `kernels/${encodeURIComponent(kernelId)}/resume`,
      { method: 'POST', body: ahead ? '{"ahead": true}' : '{}' }
    );
    return reply.data;
  }

  private async _request<T>(
    path: string,
    init: RequestInit = {}
  ): Promise<ITimed<T>> {
    const url = URLExt.join(this.serverSettings.baseUrl, 'api/gpupool', path);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(
        url,
        { ...init, cache: 'no-store' },
        this.serverSettings
      );
    } catch (error) {
      throw new GpuPoolRequestError(
        `cannot reach the Jupyter server: ${(error as Error).message}`,
        0
      );
    }
    const text = await response.text();
    let data: any = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch {
        data = null;
      }
    }
    if (!response.ok) {
      throw new GpuPoolRequestError(errorMessage(response.status, data), response.status);
    }
    const date = response.headers.get('Date');
    const parsed = date ? Date.parse(date) : NaN;
    return {
      data: data as T,
      serverTime: isNaN(parsed) ? null : parsed / 1000
    };
  }
}
