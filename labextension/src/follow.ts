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
  /** Whether to resume a suspended kernel when a cell of its notebook is edited (the setting `resumeAhead`). */
  resumeAhead?: () => boolean;
}

/**
 * Whether an edit of a cell with this text is work that will need the GPU: not a cell whose text
 * begins with `%` (`%gpupool status` only looks, and looking never resumes a kernel).
 */
export function editWantsGpu(source: string | null | undefined): boolean {
  const text = (source ?? '').trimStart();
  return text !== '' && !text.startsWith('%');
}

/** The active cell's model of a notebook panel (null for a console), and its source text. */
function activeCell(widget: SessionWidget | null): { model: object; source: string } | null {
  const model = (widget as any)?.content?.activeCell?.model;
  if (!model) {
    return null;
  }
  const source = model.sharedModel?.getSource ? model.sharedModel.getSource() : model.toJSON?.()?.source;
  return { model, source: Array.isArray(source) ? source.join('') : String(source ?? '') };
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
    (this._current as any)?.content?.activeCellChanged?.disconnect(this._onActiveCell, this);
    this._current = widget;
    if (widget) {
      const ctx = widget.sessionContext;
      ctx.kernelChanged.connect(this._update, this);
      ctx.sessionChanged.connect(this._update, this);
      ctx.statusChanged.connect(this._onStatus, this);
      ctx.disposed.connect(this._onDisposed, this);
      this._documentModel(widget)?.contentChanged.connect(this._onEdited, this);
      (widget as any).content?.activeCellChanged?.connect(this._onActiveCell, this);
      this._onActiveCell();
    }
    this._fresh = true; // opening or focusing a notebook only looks: the next edit reads the kernel's state afresh
    this._update();
  }

  /** The notebook's document model (a console has none): its `contentChanged` says a cell was edited. */
  private _documentModel(widget: SessionWidget | null): { contentChanged: ISignal<any, void> } | null {
    const model = (widget as any)?.context?.model;
    return model && model.contentChanged ? model : null;
  }

  /** A cell was edited: the user is working, so a suspended kernel's memory starts on its way back, unless the cell only looks. */
  private _onEdited(): void {
    // The notebook's content changes for outputs and new cells too: only a change of the active
    // cell's own text is the user's edit.
    const cell = activeCell(this._current);
    if (!cell || this._seen.get(cell.model) === cell.source) {
      return;
    }
    this._seen.set(cell.model, cell.source);
    if (!editWantsGpu(cell.source)) {
      return;
    }
    const fresh = this._fresh;
    this._fresh = false;
    this._resumeAhead(fresh);
  }

  /** A cell became active: its text now is what an edit is told from. */
  private _onActiveCell(): void {
    const cell = activeCell(this._current);
    if (cell) {
      this._seen.set(cell.model, cell.source);
    }
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
    if (changed) {
      this._fresh = true; // a kernel that became known (opened, reconnected) is only looked at
    }
  }

  private _current: SessionWidget | null = null;
  private _fresh = true;
  private _seen = new WeakMap<object, string>();
  private _disposed = false;
}
