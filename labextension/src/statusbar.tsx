/**
 * The status-bar item: `GPU 3.1 / 8 GiB` granted, `GPU queued #2` waiting.
 * Clicking it (or Enter/Space when focused) opens the panel. The same widget is the
 * top-bar item of Notebook 7, which has no status bar; there it hides itself while it
 * has nothing to say.
 */

import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import * as React from 'react';

import { gpuIcon } from './icon';
import { GpuPoolModel } from './model';

/** Options of the status item. */
export interface IGpuPoolStatusOptions {
  /** Hide the widget itself while there is no text (the status bar hides it otherwise). */
  hideWhenEmpty?: boolean;
}

export class GpuPoolStatus extends ReactWidget {
  constructor(
    readonly model: GpuPoolModel,
    private readonly _open: () => void,
    options: IGpuPoolStatusOptions = {}
  ) {
    super();
    this._hideWhenEmpty = !!options.hideWhenEmpty;
    this.addClass('jp-GpuPool-status');
    this.node.tabIndex = 0;
    this.node.setAttribute('role', 'button');
    this.node.addEventListener('click', this);
    this.node.addEventListener('keydown', this);
    this.model.changed.connect(this._updateNode, this);
    this._updateNode();
  }

  handleEvent(event: Event): void {
    if (event.type === 'click') {
      this._open();
    } else if (event.type === 'keydown') {
      const key = (event as KeyboardEvent).key;
      if (key === 'Enter' || key === ' ') {
        event.preventDefault();
        this._open();
      }
    }
  }

  dispose(): void {
    this.node.removeEventListener('click', this);
    this.node.removeEventListener('keydown', this);
    super.dispose();
  }

  /** Whether there is anything to show (the item hides otherwise). */
  get hasText(): boolean {
    return this.model.view.statusText !== '';
  }

  render(): JSX.Element {
    return (
      <UseSignal signal={this.model.changed}>
        {() => {
          const view = this.model.view;
          return (
            <span className={`jp-GpuPool-statusInner jp-mod-${view.phase}`}>
              <gpuIcon.react tag="span" className="jp-GpuPool-statusIcon" />
              <span className="jp-GpuPool-statusText">{view.statusText}</span>
            </span>
          );
        }}
      </UseSignal>
    );
  }

  private readonly _hideWhenEmpty: boolean;

  private _updateNode(): void {
    const view = this.model.view;
    if (this._hideWhenEmpty) {
      this.node.classList.toggle('jp-mod-empty', view.statusText === '');
    }
    const title = view.statusTitle || view.summary;
    this.node.title = `${title}\nClick to open the GPU pool panel.`;
    this.node.setAttribute('aria-label', `${view.statusText || 'GPU'}: ${title}. Open the GPU pool panel`);
  }
}
