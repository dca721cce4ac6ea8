import { LabIcon } from '@jupyterlab/ui-components';

/** A GPU board: the sidebar tab and status-bar icon, themed like JupyterLab's own icons. */
const svgstr = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M2 6h17a2 2 0 0 1 2 2v8a2 2 0 0 1-2 2h-6v2h-2v-2H7v2H5v-2H4v3H2zm4 3v6h12V9zm2 1h3v4H8zm5 0h3v4h-3z"/>
    <path d="M21 10h1.5v1H21zm0 3h1.5v1H21z"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({ name: 'jupyter-gpupool:gpu', svgstr });
