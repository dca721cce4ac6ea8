/**
 * Toasts for the moments a user must not miss even with the panel closed:
 * the kernel waits for a GPU (so "Connecting" does not look like a hang), the GPU is
 * granted, an idle slice is about to go back (with Keep), and a slice was reclaimed.
 */

import { Notification } from '@jupyterlab/apputils';
import { IDisposable } from '@lumino/disposable';

import { GpuPoolModel } from './model';
import { IKernelView } from './view';

export interface INotifierOptions {
  enabled: () => boolean;
  keepDuration: () => string;
  openPanel: () => void;
}

export class GpuPoolNotifier implements IDisposable {
  constructor(
    private readonly _model: GpuPoolModel,
    private readonly _options: INotifierOptions
  ) {
    _model.changed.connect(this._onChanged, this);
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._model.changed.disconnect(this._onChanged, this);
    this._dismissAll();
  }

  private _onChanged(): void {
    const kernelId = this._model.kernelId;
    const view = this._model.view;
    if (kernelId !== this._kernelId) {
      // Another kernel is current: start over without announcing its present state,
      // except a queue, which is what the user must see.
      this._dismissAll();
      this._kernelId = kernelId;
      this._last = null;
    }
    const previous = this._last;
    this._last = view;
    if (!this._options.enabled() || !kernelId) {
      this._dismissAll();
      return;
    }
    const label = this._model.kernelLabel || 'this kernel';
    const open = { label: 'Show', callback: () => this._options.openPanel() };
    this._announceQueue(view, label, open);
    this._announceIdle(view, label, open, kernelId);
    if (
      view.phase === 'released' &&
      !/by (the )?user/i.test(view.released ?? '') &&
      previous &&
      (previous.phase === 'granted' || previous.phase === 'suspended' || previous.phase === 'queued')
    ) {
      Notification.warning(`${label}: GPU slice released — ${view.released}.`, {
        autoClose: 10000,
        actions: [open]
      });
    }
  }

  /** One toast while the kernel waits, kept up to date, that turns into "granted" when it is. */
  private _announceQueue(view: IKernelView, label: string, open: Notification.IAction): void {
    if (view.phase === 'queued' && view.queue) {
      const text = `${label}: ${view.queue.text}`;
      if (this._queueId) {
        if (text !== this._queueText) {
          Notification.update({ id: this._queueId, message: text, type: 'info', autoClose: false });
        }
      } else {
        this._queueId = Notification.info(text, { autoClose: false, actions: [open] });
      }
      this._queueText = text;
    } else if (this._queueId) {
      if (view.phase === 'granted') {
        Notification.update({
          id: this._queueId,
          message: `${label}: GPU granted — ${view.summary}`,
          type: 'success',
          autoClose: 4000,
          actions: []
        });
      } else {
        Notification.dismiss(this._queueId);
      }
      this._queueId = null;
      this._queueText = '';
    }
  }

  /** A warning with Keep while an idle slice counts down, gone once it is not idle. */
  private _announceIdle(
    view: IKernelView,
    label: string,
    open: Notification.IAction,
    kernelId: string
  ): void {
    if (view.idle && !this._idleId) {
      const keep = this._options.keepDuration();
      const onKeep = () =>
        void this._model.keep(kernelId, keep).catch(error =>
          Notification.error(`Keep failed: ${(error as Error).message}`, {
            autoClose: 8000
          })
        );
      this._idleId = Notification.warning(
        view.idle.suspends
          ? `${label}: idle kernel will be suspended (variables kept) in ${view.idle.countdown} (${view.idle.reason}).`
          : `${label}: idle GPU slice goes back to the pool in ${view.idle.countdown} (${view.idle.reason}).`,
        {
          autoClose: false,
          actions: [{ label: `Keep ${keep}`, displayType: 'accent', callback: onKeep }, open]
        }
      );
    } else if (!view.idle && this._idleId) {
      Notification.dismiss(this._idleId);
      this._idleId = null;
    }
  }

  private _dismissAll(): void {
    for (const id of [this._queueId, this._idleId]) {
      if (id) {
        Notification.dismiss(id);
      }
    }
    this._queueId = null;
    this._idleId = null;
    this._queueText = '';
  }

  private _disposed = false;
  private _idleId: string | null = null;
  private _kernelId: string | null = null;
  private _last: IKernelView | null = null;
  private _queueId: string | null = null;
  private _queueText = '';
}
