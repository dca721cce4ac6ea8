/**
 * Follow the kernel of the current notebook (or console) and tell the model.
 */

import { ISessionContext } from '@jupyterlab/apputils';
import { IDisposable } from '@lumino/disposable';
import { ISignal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { GpuPoolModel } from './model';

/** A widget with a kernel session: a notebook panel or a console panel. */
export type SessionWidget = Widget & { sessionContext: ISessionContext };

/** The part of a widget tracker we use. */
export interface ISessionTracker {
  readonly currentWidget: SessionWidget | null;
  readonly currentChanged: ISignal<any, SessionWidget | null>;
}

/** Options of a {@link KernelFollower}. */
export interface IKernelFollowerOptions {
  /** Whether to resume a suspended kernel when its notebook gets focus or an edit (the setting `resumeAhead`). */
  resumeAhead?: () => boolean;
}

export class KernelFollower implements IDisposable {
  constructor(
    private readonly _model: GpuPoolModel,
    private readonly _trackers: ISessionTracker[],
    private readonly _options: IKernelFollowerOptions = {}
  ) {
    for (const tracker of _trackers) {
      tracker.currentChanged.connect(this._onCurrentChanged, this);
    }
    const first = _trackers.map(t => t.currentWidget).find(w => !!w) ?? null;
    this._follow(first);
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._follow(null);
    for (const tracker of this._trackers) {
      tracker.currentChanged.disconnect(this._onCurrentChanged, this);
    }
  }

  private _onCurrentChanged(_: unknown, widget: SessionWidget | null): void {
    if (widget) {
      this._follow(widget);
    } else if (!this._current || this._current.isDisposed) {
      const other = this._trackers.map(t => t.currentWidget).find(w => !!w) ?? null;
      this._follow(other);
    }
  }

  private _follow(widget: SessionWidget | null): void {
    if (widget === this._current) {
      this._update();
      return;
    }
    if (this._current) {
      const ctx = this._current.sessionContext;
      ctx.kernelChanged.disconnect(this._update, this);
      ctx.sessionChanged.disconnect(this._update, this);
      ctx.statusChanged.disconnect(this._onStatus, this);
      ctx.disposed.disconnect(this._onDisposed, this);
    }
    this._documentModel(this._current)?.contentChanged.disconnect(this._onEdited, this);
    this._current = widget;
    if (widget) {
      const ctx = widget.sessionContext;
      ctx.kernelChanged.connect(this._update, this);
      ctx.sessionChanged.connect(this._update, this);
      ctx.statusChanged.connect(this._onStatus, this);
      ctx.disposed.connect(this._onDisposed, this);
      this._documentModel(widget)?.contentChanged.connect(this._onEdited, this);
    }
    this._update();
    if (widget) {
      this._resumeAhead(true); // the notebook got focus: a suspended kernel's memory starts on its way back
    }
  }

  /** The notebook's document model (a console has none): its `contentChanged` says a cell was edited. */
  private _documentModel(widget: SessionWidget | null): { contentChanged: ISignal<any, void> } | null {
    const model = (widget as any)?.context?.model;
    return model && model.contentChanged ? model : null;
  }

  private _onEdited(): void {
    this._resumeAhead();
  }

  private _resumeAhead(fresh = false): void {
    const kernelId = this._current?.sessionContext?.session?.kernel?.id;
    const wanted = this._options.resumeAhead ? this._options.resumeAhead() : true;
    if (kernelId && wanted) {
      void this._model.resumeAhead(kernelId, fresh);
    }
  }

  private _onDisposed(): void {
    const other =
      this._trackers
        .map(t => t.currentWidget)
        .find(w => !!w && w !== this._current && !w.isDisposed) ?? null;
    this._follow(other);
  }

  private _onStatus(_: ISessionContext, status: string): void {
    this._update();
    // A queued kernel turns idle when granted: ask at once rather than at the next tick.
    if (status === 'idle' && ['queued', 'loading'].includes(this._model.view.phase)) {
      void this._model.refresh();
    }
  }

  private _update(): void {
    const ctx = this._current?.sessionContext;
    const kernelId = ctx?.session?.kernel?.id ?? null;
    const changed = kernelId !== this._model.kernelId;
    this._model.setKernel(kernelId, ctx?.path || ctx?.name || '');
    if (changed && kernelId) {
      this._resumeAhead(true); // a notebook whose kernel became known (opened, reconnected)
    }
  }

  private _current: SessionWidget | null = null;
  private _disposed = false;
}
