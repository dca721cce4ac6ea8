/**
 * The right-sidebar panel: the current kernel's lease, its actions, and the pool.
 */

import { Dialog, showDialog } from '@jupyterlab/apputils';
import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { gpuIcon } from './icon';
import { GpuPoolModel } from './model';
import {
  IBar,
  checkReserve,
  IDeviceView,
  IKernelView,
  IPoolView,
  IReservationView
} from './view';

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

/** One GPU: its leases stacked as segments, the memory in use as a line, and its text. */
function DeviceItem(props: { device: IDeviceView }): JSX.Element {
  const { device } = props;
  return (
    <li className="jp-GpuPool-device">
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
  );
}

/** What the colours of the pool bars mean. */
function PoolLegend(props: { pool: IPoolView }): JSX.Element {
  const { pool } = props;
  return (
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
  );
}

/** Capacity held for users or groups, open ones first (nothing when there is none). */
function ReservationList(props: { reservations: IReservationView[] }): JSX.Element | null {
  if (props.reservations.length === 0) {
    return null;
  }
  return (
    <div className="jp-GpuPool-reservations">
      <h4 className="jp-GpuPool-subheading">Reservations</h4>
      <ul aria-label="Reservations">
        {props.reservations.map(r => (
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
  );
}

/** The user's quota and use (nothing when the server sends none). */
function QuotaList(props: { quota: IPoolView['quota'] }): JSX.Element | null {
  if (props.quota.length === 0) {
    return null;
  }
  return (
    <dl className="jp-GpuPool-quota" aria-label="Your quota and use">
      {props.quota.map(line => (
        <React.Fragment key={line.label}>
          <dt>{line.label}</dt>
          <dd>{line.value}</dd>
        </React.Fragment>
      ))}
    </dl>
  );
}

/** The pool: why it is unavailable, its GPUs, the queue, reservations, quota, who is signed in. */
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
              <DeviceItem key={device.key} device={device} />
            ))}
          </ul>
          <PoolLegend pool={pool} />
          <p className="jp-GpuPool-queueLength">Queue: {pool.queueText}</p>
          <ReservationList reservations={pool.reservations} />
          <QuotaList quota={pool.quota} />
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

/** The outcome of the last action, shown under the form. */
interface IActionMessage {
  text: string;
  error: boolean;
}

/** What the buttons of the panel do to the current kernel, and how the last one went. */
interface ILeaseActions {
  busy: boolean;
  message: IActionMessage | null;
  keep: () => void;
  reserve: (body: { memory?: string; duration?: string }) => Promise<void>;
  suspend: () => void;
  resume: () => void;
  release: () => Promise<void>;
}

/** The panel's actions on the current kernel: one at a time, each saying how it went. */
function useLeaseActions(model: GpuPoolModel, options: IPanelOptions): ILeaseActions {
  const kernelId = model.kernelId;
  const [busy, setBusy] = React.useState(false);
  const [message, setMessage] = React.useState<IActionMessage | null>(null);

  // Forget form feedback when following another kernel.
  const lastKernel = React.useRef(kernelId);
  if (lastKernel.current !== kernelId) {
    lastKernel.current = kernelId;
    if (message) {
      setMessage(null);
    }
  }

  const act = async (what: string, action: (id: string) => Promise<void>, done: string) => {
    if (!kernelId) {
      return;
    }
    setBusy(true);
    setMessage(null);
    try {
      await action(kernelId);
      setMessage({ text: done, error: false });
    } catch (error) {
      setMessage({ text: `${what} failed: ${(error as Error).message}`, error: true });
    } finally {
      setBusy(false);
    }
  };

  const keep = () => {
    const d = options.keepDuration();
    void act('Keep', id => model.keep(id, d), `Kept through idle for ${d}.`);
  };
  const reserve = (body: { memory?: string; duration?: string }) =>
    act('Reserve', id => model.reserve(id, body), reservedText(body));
  const suspend = () =>
    void act(
      'Suspend',
      id => model.suspend(id),
      'Suspending: the GPU memory goes to host RAM; the next cell brings it back.'
    );
  const resume = () =>
    void act(
      'Resume',
      id => model.resume(id),
      'Resuming: the kernel waits for a GPU, then its memory is restored.'
    );
  const release = async () => {
    if (await confirmRelease(model.kernelLabel)) {
      await act('Release', id => model.release(id), 'Released.');
    }
  };
  return { busy, message, keep, reserve, suspend, resume, release };
}

/** `Reserved: 12GiB, held for 2h.` */
function reservedText(body: { memory?: string; duration?: string }): string {
  return (
    'Reserved: ' +
    [body.memory, body.duration ? `held for ${body.duration}` : ''].filter(Boolean).join(', ') +
    '.'
  );
}

/** Ask before a slice goes back to the pool. */
async function confirmRelease(kernelLabel: string): Promise<boolean> {
  const result = await showDialog({
    title: 'Release the GPU slice?',
    body:
      `The kernel of ${kernelLabel || 'this notebook'} gives its GPU memory back ` +
      'to the pool; others waiting can use it at once.',
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Release' })]
  });
  return result.button.accept;
}

/** The panel: the current kernel's lease, the actions while it has one, and the pool. */
function PanelBody(props: {
  model: GpuPoolModel;
  options: IPanelOptions;
}): JSX.Element {
  const { model, options } = props;
  const view: IKernelView = model.view;
  const pool = model.poolView;
  const actions = useLeaseActions(model, options);
  const form = useReserveForm();
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
      <LeaseSection view={view} actions={actions} keepDuration={options.keepDuration()} />
      {live && (
        <ActionsSection
          view={view}
          actions={actions}
          form={form}
          keepDuration={options.keepDuration()}
          largestGpu={pool?.largestGpu ?? null}
        />
      )}
      <PoolSection pool={pool} error={model.poolError} />
    </div>
  );
}

/** What a part of the lease section shows, and the actions its buttons take. */
interface ILeaseProps {
  view: IKernelView;
  actions: ILeaseActions;
  keepDuration: string;
}

/** This kernel: its phase, where it stands, its slice and use, and what happens next. */
function LeaseSection(props: ILeaseProps): JSX.Element {
  const { view } = props;
  return (
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
      <SuspendedPart {...props} />
      {view.queue && (
        <div className="jp-GpuPool-queue" role="status" aria-live="polite">
          <div className="jp-GpuPool-progress" aria-hidden="true" />
          <p className="jp-GpuPool-queueText">{view.queue.text}</p>
          {view.queue.reason && <p className="jp-GpuPool-muted">{view.queue.reason}</p>}
        </div>
      )}
      <UsePart {...props} />
      <IdlePart {...props} />
    </section>
  );
}

/** A suspended kernel: what is parked, why, and Resume. */
function SuspendedPart(props: ILeaseProps): JSX.Element | null {
  const { view, actions } = props;
  if (!view.suspended) {
    return null;
  }
  return (
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
          disabled={actions.busy}
          onClick={actions.resume}
          title="Queue for a GPU now instead of waiting for the next cell"
        >
          Resume
        </button>
      )}
    </div>
  );
}

/** The slice and its use: the bars, an elastic slice's steps, use over the limit, a shrink hint. */
function UsePart(props: ILeaseProps): JSX.Element {
  const { view, actions } = props;
  return (
    <>
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
            disabled={actions.busy}
            onClick={() => void actions.reserve({ memory: view.hint!.memory })}
          >
            {view.hint.button}
          </button>
        </div>
      )}
    </>
  );
}

/** What happens next: the idle countdown with Keep, kept, released, and how the slice is enforced. */
function IdlePart(props: ILeaseProps): JSX.Element {
  const { view, actions } = props;
  return (
    <>
      {view.idle && (
        <div className="jp-GpuPool-idle" role="timer" aria-live="off">
          <p>
            <strong>Idle:</strong> {view.idle.text}.{' '}
            <span className="jp-GpuPool-muted">({view.idle.reason})</span>
          </p>
          <button
            type="button"
            className="jp-GpuPool-button jp-mod-accept"
            disabled={actions.busy}
            onClick={actions.keep}
            aria-label={`Keep the slice for ${props.keepDuration}`}
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
    </>
  );
}

/** The reserve form's fields, kept by the panel so that they outlive a lease that comes and goes. */
interface IReserveForm {
  size: string;
  setSize: (value: string) => void;
  duration: string;
  setDuration: (value: string) => void;
  touched: boolean;
  setTouched: (value: boolean) => void;
}

function useReserveForm(): IReserveForm {
  const [size, setSize] = React.useState('');
  const [duration, setDuration] = React.useState('');
  const [touched, setTouched] = React.useState(false);
  return { size, setSize, duration, setDuration, touched, setTouched };
}

/** A labelled text input with its error line under it. */
function FormField(props: {
  id: string;
  label: string;
  value: string;
  placeholder: string;
  error: string | null;
  showError: boolean;
  onChange: (value: string) => void;
  onBlur: () => void;
}): JSX.Element {
  const errorId = `${props.id}Error`;
  return (
    <div className="jp-GpuPool-field">
      <label htmlFor={props.id}>{props.label}</label>
      <input
        id={props.id}
        className="jp-mod-styled"
        value={props.value}
        placeholder={props.placeholder}
        autoComplete="off"
        spellCheck={false}
        aria-invalid={props.showError && !!props.error}
        aria-describedby={errorId}
        onChange={e => props.onChange(e.target.value)}
        onBlur={props.onBlur}
      />
      <div id={errorId} className="jp-GpuPool-fieldError">
        {props.showError ? props.error : ''}
      </div>
    </div>
  );
}

/** The actions on a live lease: reserve a size or a hold, keep, suspend, release. */
function ActionsSection(props: {
  view: IKernelView;
  actions: ILeaseActions;
  form: IReserveForm;
  keepDuration: string;
  largestGpu: number | null;
}): JSX.Element {
  const { view, actions, form, keepDuration } = props;
  const { size, duration, touched } = form;
  const check = checkReserve(size, duration, view.gpuMemory, props.largestGpu);
  const showErrors = touched && (size.trim() !== '' || duration.trim() !== '');
  const onSubmit = (event: React.FormEvent) => {
    event.preventDefault();
    form.setTouched(true);
    if (!check.ok) {
      return;
    }
    void actions.reserve(check.body).then(() => {
      form.setSize('');
      form.setDuration('');
      form.setTouched(false);
    });
  };
  const message = actions.message;
  return (
    <section className="jp-GpuPool-section" aria-labelledby="jp-GpuPool-actionsTitle">
      <h3 id="jp-GpuPool-actionsTitle" className="jp-GpuPool-heading">
        Actions
      </h3>
      <form className="jp-GpuPool-form" onSubmit={onSubmit} noValidate>
        <FormField
          id="jp-GpuPool-size"
          label="Size"
          value={size}
          placeholder="e.g. 12GiB or 25%"
          error={check.sizeError}
          showError={showErrors}
          onChange={form.setSize}
          onBlur={() => form.setTouched(true)}
        />
        <FormField
          id="jp-GpuPool-duration"
          label="Hold for"
          value={duration}
          placeholder="e.g. 2h or 1h30m"
          error={check.durationError}
          showError={showErrors}
          onChange={form.setDuration}
          onBlur={() => form.setTouched(true)}
        />
        {touched && check.formError && (
          <div className="jp-GpuPool-fieldError">{check.formError}</div>
        )}
        <ActionButtons
          view={view}
          actions={actions}
          keepDuration={keepDuration}
          reserveDisabled={actions.busy || !view.canReserve || (touched && !check.ok)}
        />
      </form>
      <div
        className={`jp-GpuPool-message${message?.error ? ' jp-mod-error' : ''}`}
        role={message?.error ? 'alert' : 'status'}
        aria-live="polite"
      >
        {message?.text ?? ''}
      </div>
    </section>
  );
}

/** Reserve (submits the form), Keep, Suspend and Release, each where the lease allows it. */
function ActionButtons(props: ILeaseProps & { reserveDisabled: boolean }): JSX.Element {
  const { view, actions, keepDuration } = props;
  return (
    <div className="jp-GpuPool-buttons">
      <button type="submit" className="jp-GpuPool-button jp-mod-accept" disabled={props.reserveDisabled}>
        Reserve
      </button>
      {view.canKeep && (
        <button
          type="button"
          className="jp-GpuPool-button"
          disabled={actions.busy}
          onClick={actions.keep}
          title={`Hold the slice through idle for ${keepDuration}`}
        >
          Keep {keepDuration}
        </button>
      )}
      {view.canSuspend && (
        <button
          type="button"
          className="jp-GpuPool-button"
          disabled={actions.busy}
          onClick={actions.suspend}
          title="Park the GPU memory in host RAM now (variables kept); the next cell resumes it"
        >
          Suspend
        </button>
      )}
      <button
        type="button"
        className="jp-GpuPool-button jp-mod-warn"
        disabled={actions.busy || !view.canRelease}
        onClick={() => void actions.release()}
      >
        Release
      </button>
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
