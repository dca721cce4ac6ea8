import { Token } from '@lumino/coreutils';

import type { GpuPoolModel } from './model';

/** The page's one GPU-pool model, for other extensions (e.g. a kernel picker). */
export const IGpuPoolModel = new Token<GpuPoolModel>(
  'jupyter-gpupool:IGpuPoolModel',
  'The GPU pool model of the page: the current kernel’s lease and the pool, kept up to date.'
);
