/**
 * The REST client's suspend and resume: the URL and method the server extension routes,
 * the status body passed on, and a refusal (409) read as the server's one-line message.
 */
import { ServerConnection } from '@jupyterlab/services';

import { GpuPoolClient } from '../src/api';
import { GpuPoolRequestError } from '../src/types';
import { GIB } from '../src/units';

/** A client whose requests go to `answer` instead of the network, and the requests it made. */
function client(answer: (url: string, method: string) => Response) {
  const requests: Array<{ url: string; method: string; body: string | null }> = [];
  const fetch = async (request: Request) => {
    const body = request.body ? await request.text() : null;
    const url = request.url.replace(/\?\d+$/, ''); // the cache-busting suffix of `cache: 'no-store'`
    requests.push({ url, method: request.method, body });
    return answer(url, request.method);
  };
  const settings = ServerConnection.makeSettings({
    baseUrl: 'http://lab.example/user/alice/',
    wsUrl: 'ws://lab.example/user/alice/',
    fetch: fetch as unknown as typeof globalThis.fetch
  });
  return { client: new GpuPoolClient(settings), requests };
}

const json = (body: unknown, status = 200) =>
  new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } });

describe('GpuPoolClient suspend and resume', () => {
  it('POSTs .../suspend and passes the status body on', async () => {
    const body = { lease_id: 'l1', state: 'granted', memory: 8 * GIB, transition: 'suspending', suspendable: true };
    const { client: c, requests } = client(() => json(body));
    expect(await c.suspendKernel('k/1')).toEqual(body);
    expect(requests).toEqual([
      { url: 'http://lab.example/user/alice/api/gpupool/kernels/k%2F1/suspend', method: 'POST', body: '{}' }
    ]);
  });

  it('POSTs .../resume and passes the status body on', async () => {
    const body = { lease_id: 'l1', state: 'queued', memory: 8 * GIB, resuming: true, queue_position: 2 };
    const { client: c, requests } = client(() => json(body));
    expect(await c.resumeKernel('k1')).toEqual(body);
    expect(requests.map(r => [r.url, r.method])).toEqual([
      ['http://lab.example/user/alice/api/gpupool/kernels/k1/resume', 'POST']
    ]);
  });

  it('reads a refusal (409) as the server’s one-line reason', async () => {
    const why = 'cannot suspend this kernel: the pool’s reclaim action is cull';
    const { client: c } = client(() => json({ message: why }, 409));
    const error = await c.suspendKernel('k1').catch(e => e);
    expect(error).toBeInstanceOf(GpuPoolRequestError);
    expect(error.status).toBe(409);
    expect(error.message).toBe(why);
  });

  it('says what a 409 means when the server gives no message', async () => {
    const { client: c } = client(() => new Response('', { status: 409 }));
    await expect(c.resumeKernel('k1')).rejects.toThrow('the request conflicts with the pool state; try again');
  });
});
