/**
 * The right-sidebar panel: the current kernel's lease, its actions, and the pool.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { gpuIcon } from './icon';
import { GpuPoolModel } from './model';
import { IBar, checkReserve, IKernelView, IPoolView } from './view';

/** What the panel needs besides the model. */
export interface IPanelOptions {
  /** How long Keep holds a slice through idle (the `keepDuration` setting). */
  keepDuration: () => string;
}

/** The sidebar widget. */
export class GpuPoolPanel extends ReactWidget {
  constructor(
    readonly model: GpuPoolModel,
    readonly options: IPanelOptions
  ) {
    super();
    this.id = 'jupyter-gpupool-panel';
    this.addClass('jp-GpuPool-panel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPU pool: your kernel’s GPU slice and the queue';
    this.title.label = '';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU pool');
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this.model.poolWanted = true;
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this.model.poolWanted = false;
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this.model.poolWanted = this.isVisible;
  }

  protected onBeforeDetach(msg: Message): void {
    this.model.poolWanted = false;
    super.onBeforeDetach(msg);
  }

  render(): JSX.Element {
    return (
      <UseSignal signal={this.model.changed}>
        {() => <PanelBody model={this.model} options={this.options} />}
      </UseSignal>
    );
  }
}

/** A labelled bar with `role="meter"`: a fill and optional markers. */
function Meter(props: {
  bar: IBar;
  name: string;
  className?: string;
}): JSX.Element {
  const { bar } = props;
  const percent = Math.round(bar.fraction * 100);
  return (
    <div className={`jp-GpuPool-meterRow ${props.className ?? ''}`}>
      <div
        className={`jp-GpuPool-meter${bar.warn ? ' jp-mod-warn' : ''}`}
        role="meter"
        aria-label={props.name}
        aria-valuemin={0}
        aria-valuemax={100}
        aria-valuenow={percent}
        aria-valuetext={bar.label}
        title={bar.label}
      >
        <div
          className="jp-GpuPool-meterFill"
          style={{ width: `${bar.fraction * 100}%` }}
        />
        {bar.markers.map(m => (
          <div
            key={m.label}
            className="jp-GpuPool-meterMarker"
            style={{ left: `calc(${m.fraction * 100}% - 1px)` }}
            title={m.label}
          />
        ))}
      </div>
      <div className="jp-GpuPool-meterLabel">{bar.label}</div>
    </div>
  );
}

function PoolSection(props: { pool: IPoolView | null; error: string | null }): JSX.Element {
  const { pool, error } = props;
  return (
    <section className="jp-GpuPool-section" aria-labelledby="jp-GpuPool-poolTitle">
      <h3 id="jp-GpuPool-poolTitle" className="jp-GpuPool-heading">
        The pool
      </h3>
      {!pool && (
        <p className="jp-GpuPool-muted">
          {error ? `Pool unavailable: ${error}` : 'Loading…'}
        </p>
      )}
      {pool?.unavailable && (
        <div className="jp-GpuPool-unavailable" role="alert">
          <strong>{pool.unavailable.title}</strong>
          <p>{pool.unavailable.reason}</p>
          <p className="jp-GpuPool-muted">{pool.unavailable.kernels}</p>
        </div>
      )}
      {pool && (
        <>
          <ul className="jp-GpuPool-devices">
            {pool.devices.map(device => (
              <li key={device.key} className="jp-GpuPool-device">
                <div className="jp-GpuPool-deviceTitle">{device.title}</div>
                <div
                  className={`jp-GpuPool-stack${device.healthy ? '' : ' jp-mod-unhealthy'}`}
                  role="img"
                  aria-label={device.ariaLabel}
                >
                  {device.segments.map(s => (
                    <div
                      key={s.key}
                      className={
                        'jp-GpuPool-segment' +
                        (s.mine ? ' jp-mod-mine' : '') +
                        (s.current ? ' jp-mod-current' : '') +
                        (s.outside ? ' jp-mod-outside' : '')
                      }
                      style={{ width: `${s.fraction * 100}%` }}
                      title={s.label}
                    />
                  ))}
                  {device.usedFraction !== null && (
                    <div
                      className="jp-GpuPool-usedLine"
                      style={{ width: `${device.usedFraction * 100}%` }}
                      title="memory in use on this GPU"
                    />
                  )}
                </div>
                <div className="jp-GpuPool-deviceText">{device.text}</div>
                {device.outside && (
                  <ul
                    className="jp-GpuPool-outside"
                    aria-label={`${device.title}: ${device.outside.label}`}
                  >
                    {device.outside.lines.map((line, i) => (
                      <li key={`${i}:${line}`}>{line}</li>
                    ))}
                  </ul>
                )}
              </li>
            ))}
          </ul>
          <div className="jp-GpuPool-legend" aria-hidden="true">
            <span className="jp-GpuPool-swatch jp-mod-current" /> this kernel
            <span className="jp-GpuPool-swatch jp-mod-mine" /> yours
            <span className="jp-GpuPool-swatch" /> {pool.admin ? 'others' : 'other users'}
            {pool.outside && (
              <>
                <span className="jp-GpuPool-swatch jp-mod-outside" /> outside the pool
              </>
            )}
          </div>
          <p className="jp-GpuPool-queueLength">Queue: {pool.queueText}</p>
          {pool.reservations.length > 0 && (
            <div className="jp-GpuPool-reservations">
              <h4 className="jp-GpuPool-subheading">Reservations</h4>
              <ul aria-label="Reservations">
                {pool.reservations.map(r => (
                  <li
                    key={r.key}
                    className={`jp-GpuPool-reservation${r.active ? ' jp-mod-active' : ''}`}
                  >
                    <strong>{r.name}</strong> ({r.who}): {r.memory}, {r.window}
                    {r.active && <span className="jp-GpuPool-badge jp-mod-active">active now</span>}
                  </li>
                ))}
              </ul>
            </div>
          )}
          {pool.quota.length > 0 && (
            <dl className="jp-GpuPool-quota" aria-label="Your quota and use">
              {pool.quota.map(line => (
                <React.Fragment key={line.label}>
                  <dt>{line.label}</dt>
                  <dd>{line.value}</dd>
                </React.Fragment>
              ))}
            </dl>
          )}
          {pool.user && (
            <p className="jp-GpuPool-muted">
              Signed in as {pool.user}
              {pool.admin ? ' (admin: owners shown)' : ''}
            </p>
          )}
        </>
      )}
    </section>
  );
}

function PanelBody(props: {
  model: GpuPoolModel;
  options: IPanelOptions;
}): JSX.Element {
  const { model, options } = props;
  const view: IKernelView = model.view;
  const pool = model.poolView;
  const kernelId = model.kernelId;
  const [size, setSize] = React.useState('');
  const [duration, setDuration] = React.useState('');
  const [touched, setTouched] = React.useState(false);
  const [busy, setBusy] = React.useState(false);
  const [message, setMessage] = React.useState<{ text: string; error: boolean } | null>(null);

  // Forget form feedback when following another kernel.
  const lastKernel = React.useRef(kernelId);
  if (lastKernel.current !== kernelId) {
    lastKernel.current = kernelId;
    if (message) {
      setMessage(null);
    }
  }

  const check = checkReserve(size, duration, view.gpuMemory, pool?.largestGpu ?? null);
  const showErrors = touched && (size.trim() !== '' || duration.trim() !== '');

  const act = async (what: string, action: () => Promise<void>, done: string) => {
    if (!kernelId) {
      return;
    }
    setBusy(true);
    setMessage(null);
    try {
      await action();
      setMessage({ text: done, error: false });
    } catch (error) {
      setMessage({ text: `${what} failed: ${(error as Error).message}`, error: true });
    } finally {
      setBusy(false);
    }
  };

  const keep = () => {
    const d = options.keepDuration();
    void act('Keep', () => model.keep(kernelId!, d), `Kept through idle for ${d}.`);
  };

  const reserve = (body: { memory?: string; duration?: string }) =>
    act(
      'Reserve',
      () => model.reserve(kernelId!, body),
      'Reserved: ' +
        [body.memory, body.duration ? `held for ${body.duration}` : '']
          .filter(Boolean)
          .join(', ') +
        '.'
    );

  const onSubmit = (event: React.FormEvent) => {
    event.preventDefault();
    setTouched(true);
    if (!check.ok) {
      return;
    }
    void reserve(check.body).then(() => {
      setSize('');
      setDuration('');
      setTouched(false);
    });
  };

  const suspend = () =>
    void act(
      'Suspend',
      () => model.suspend(kernelId!),
      'Suspending: the GPU memory goes to host RAM; the next cell brings it back.'
    );

  const resume = () =>
    void act(
      'Resume',
      () => model.resume(kernelId!),
      'Resuming: the kernel waits for a GPU, then its memory is restored.'
    );

  const release = async () => {
    const result = await showDialog({
      title: 'Release the GPU slice?',
      body:
        `The kernel of ${model.kernelLabel || 'this notebook'} gives its GPU memory back ` +
        'to the pool; others waiting can use it at once.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Release' })]
    });
    if (result.button.accept) {
      await act('Release', () => model.release(kernelId!), 'Released.');
    }
  };

  const live = view.phase === 'queued' || view.phase === 'granted' || view.phase === 'suspended';
  return (
    <div className="jp-GpuPool-body">
      <header className="jp-GpuPool-header">
        <h2 className="jp-GpuPool-title">GPU pool</h2>
        {model.kernelLabel && (
          <div className="jp-GpuPool-kernelName" title={model.kernelLabel}>
            {model.kernelLabel}
          </div>
        )}
      </header>

      <section
        className="jp-GpuPool-section jp-GpuPool-lease"
        aria-labelledby="jp-GpuPool-leaseTitle"
        data-phase={view.phase}
      >
        <h3 id="jp-GpuPool-leaseTitle" className="jp-GpuPool-heading">
          This kernel{' '}
          <span className={`jp-GpuPool-badge jp-mod-${view.phase}`}>
            {view.badge ?? phaseLabel(view.phase)}
          </span>
        </h3>
        <p className="jp-GpuPool-summary" role="status" aria-live="polite">
          {view.summary}
        </p>
        {view.scheduler && <p className="jp-GpuPool-muted jp-GpuPool-scheduler">{view.scheduler}</p>}
        {view.transition && (
          <div className="jp-GpuPool-queue jp-GpuPool-transition" role="status" aria-live="polite">
            <div className="jp-GpuPool-progress" aria-hidden="true" />
            <p className="jp-GpuPool-transitionText">{view.transition}</p>
          </div>
        )}
        {view.suspended && (
          <div className="jp-GpuPool-suspended">
            <p className="jp-GpuPool-suspendedText">
              <strong>{view.suspended.text}</strong>
            </p>
            {view.suspended.reason && (
              <p className="jp-GpuPool-muted jp-GpuPool-suspendReason">{view.suspended.reason}</p>
            )}
            {view.canResume && (
              <button
                type="button"
                className="jp-GpuPool-button jp-mod-accept"
                disabled={busy}
                onClick={resume}
                title="Queue for a GPU now instead of waiting for the next cell"
              >
                Resume
              </button>
            )}
          </div>
        )}
        {view.queue && (
          <div className="jp-GpuPool-queue" role="status" aria-live="polite">
            <div className="jp-GpuPool-progress" aria-hidden="true" />
            <p className="jp-GpuPool-queueText">{view.queue.text}</p>
            {view.queue.reason && <p className="jp-GpuPool-muted">{view.queue.reason}</p>}
          </div>
        )}
        {view.slice && <Meter bar={view.slice} name="Slice of the GPU's memory" />}
        {view.usage && (
          <Meter bar={view.usage} name="Memory used of the slice" className="jp-GpuPool-usage" />
        )}
        {view.elastic && (
          <div className="jp-GpuPool-elastic" role="status" aria-live="polite">
            <p className="jp-GpuPool-elasticLine">{view.elastic.line}</p>
            {view.elastic.step && (
              <p
                className={`jp-GpuPool-burstStep${view.elastic.takenBack ? ' jp-mod-takenBack' : ' jp-GpuPool-muted'}`}
              >
                {view.elastic.step}
              </p>
            )}
            {view.elastic.waiting && <p className="jp-GpuPool-growWait">{view.elastic.waiting}</p>}
          </div>
        )}
        {view.burstFixed && <p className="jp-GpuPool-muted jp-GpuPool-burstFixed">{view.burstFixed}</p>}
        {view.overLimit && (
          <p className="jp-GpuPool-warning" role="alert">
            {view.overLimit}
          </p>
        )}
        {view.hint && (
          <div className="jp-GpuPool-hint">
            <span>{view.hint.text}</span>
            <button
              type="button"
              className="jp-GpuPool-button"
              disabled={busy}
              onClick={() => void reserve({ memory: view.hint!.memory })}
            >
              {view.hint.button}
            </button>
          </div>
        )}
        {view.idle && (
          <div className="jp-GpuPool-idle" role="timer" aria-live="off">
            <p>
              <strong>Idle:</strong> {view.idle.text}.{' '}
              <span className="jp-GpuPool-muted">({view.idle.reason})</span>
            </p>
            <button
              type="button"
              className="jp-GpuPool-button jp-mod-accept"
              disabled={busy}
              onClick={keep}
              aria-label={`Keep the slice for ${options.keepDuration()}`}
            >
              Keep
            </button>
          </div>
        )}
        {view.kept && <p className="jp-GpuPool-muted jp-GpuPool-kept">{view.kept}</p>}
        {view.released && (
          <p className="jp-GpuPool-released" role="status">
            <strong>Released:</strong> {view.released}
          </p>
        )}
        {view.enforcement && (
          <p className="jp-GpuPool-enforcement">
            <span className="jp-GpuPool-muted">{view.enforcement.label}:</span>{' '}
            {view.enforcement.text}
          </p>
        )}
      </section>

      {live && (
        <section className="jp-GpuPool-section" aria-labelledby="jp-GpuPool-actionsTitle">
          <h3 id="jp-GpuPool-actionsTitle" className="jp-GpuPool-heading">
            Actions
          </h3>
          <form className="jp-GpuPool-form" onSubmit={onSubmit} noValidate>
            <div className="jp-GpuPool-field">
              <label htmlFor="jp-GpuPool-size">Size</label>
              <input
                id="jp-GpuPool-size"
                className="jp-mod-styled"
                value={size}
                placeholder="e.g. 12GiB or 25%"
                autoComplete="off"
                spellCheck={false}
                aria-invalid={showErrors && !!check.sizeError}
                aria-describedby="jp-GpuPool-sizeError"
                onChange={e => setSize(e.target.value)}
                onBlur={() => setTouched(true)}
              />
              <div id="jp-GpuPool-sizeError" className="jp-GpuPool-fieldError">
                {showErrors ? check.sizeError : ''}
              </div>
            </div>
            <div className="jp-GpuPool-field">
              <label htmlFor="jp-GpuPool-duration">Hold for</label>
              <input
                id="jp-GpuPool-duration"
                className="jp-mod-styled"
                value={duration}
                placeholder="e.g. 2h or 1h30m"
                autoComplete="off"
                spellCheck={false}
                aria-invalid={showErrors && !!check.durationError}
                aria-describedby="jp-GpuPool-durationError"
                onChange={e => setDuration(e.target.value)}
                onBlur={() => setTouched(true)}
              />
              <div id="jp-GpuPool-durationError" className="jp-GpuPool-fieldError">
                {showErrors ? check.durationError : ''}
              </div>
            </div>
            {touched && check.formError && (
              <div className="jp-GpuPool-fieldError">{check.formError}</div>
            )}
            <div className="jp-GpuPool-buttons">
              <button
                type="submit"
                className="jp-GpuPool-button jp-mod-accept"
                disabled={busy || !view.canReserve || (touched && !check.ok)}
              >
                Reserve
              </button>
              {view.canKeep && (
                <button
                  type="button"
                  className="jp-GpuPool-button"
                  disabled={busy}
                  onClick={keep}
                  title={`Hold the slice through idle for ${options.keepDuration()}`}
                >
                  Keep {options.keepDuration()}
                </button>
              )}
              {view.canSuspend && (
                <button
                  type="button"
                  className="jp-GpuPool-button"
                  disabled={busy}
                  onClick={suspend}
                  title="Park the GPU memory in host RAM now (variables kept); the next cell resumes it"
                >
                  Suspend
                </button>
              )}
              <button
                type="button"
                className="jp-GpuPool-button jp-mod-warn"
                disabled={busy || !view.canRelease}
                onClick={() => void release()}
              >
                Release
              </button>
            </div>
          </form>
          <div
            className={`jp-GpuPool-message${message?.error ? ' jp-mod-error' : ''}`}
            role={message?.error ? 'alert' : 'status'}
            aria-live="polite"
          >
            {message?.text ?? ''}
          </div>
        </section>
      )}

      <PoolSection pool={pool} error={model.poolError} />
    </div>
  );
}

/** The badge text of a phase. */
function phaseLabel(phase: IKernelView['phase']): string {
  switch (phase) {
    case 'no-kernel':
      return 'no kernel';
    case 'no-lease':
      return 'no GPU';
    case 'loading':
      return '…';
    case 'cpu-only':
      return 'CPU only';
    default:
      return phase;
  }
}
