/**
 * Resume ahead of the cell: looking never resumes a suspended kernel. Opening, focusing or
 * reconnecting its notebook does not, nor does typing a cell that begins with `%`; editing any
 * other cell does (once, with a fresh read of the kernel's state).
 */
import { Signal } from '@lumino/signaling';

import { editWantsGpu, KernelFollower, SessionWidget } from '../src/follow';
import type { GpuPoolModel } from '../src/model';

class FakeCell {
  source = '';
  readonly sharedModel = { getSource: () => this.source };
}

class FakeNotebook {
  isDisposed = false;
  readonly contentChanged = new Signal<any, void>(this);
  readonly activeCellChanged = new Signal<any, void>(this);
  readonly sessionContext: any;
  readonly context: any;
  readonly content: any;

  constructor(kernelId: string) {
    const signals = { kernelChanged: new Signal(this), sessionChanged: new Signal(this), statusChanged: new Signal(this), disposed: new Signal(this) };
    this.sessionContext = { ...signals, session: { kernel: { id: kernelId } }, path: `${kernelId}.ipynb` };
    this.context = { model: { contentChanged: this.contentChanged } };
    this.content = { activeCell: { model: new FakeCell() }, activeCellChanged: this.activeCellChanged };
  }

  get cell(): FakeCell {
    return this.content.activeCell.model;
  }

  /** The user types ``text`` key by key into the active cell. */
  type(text: string): void {
    for (const key of text) {
      this.cell.source += key;
      this.contentChanged.emit();
    }
  }

  /** The active cell is run: its output arrives, and a new empty cell below becomes active. */
  run(): void {
    this.contentChanged.emit();
    this.content.activeCell = { model: new FakeCell() };
    this.activeCellChanged.emit();
    this.contentChanged.emit();
  }
}

class FakeModel {
  kernelId: string | null = null;
  view = { phase: 'granted' };
  asked: Array<[string, boolean]> = [];
  setKernel(kernelId: string | null): void {
    this.kernelId = kernelId;
  }
  async resumeAhead(kernelId: string, fresh = false): Promise<boolean> {
    this.asked.push([kernelId, fresh]);
    return true;
  }
  async refresh(): Promise<void> {}
}

class FakeTracker {
  currentWidget: SessionWidget | null = null;
  readonly currentChanged = new Signal<any, SessionWidget | null>(this);
  show(widget: FakeNotebook | null): void {
    this.currentWidget = widget as unknown as SessionWidget;
    this.currentChanged.emit(this.currentWidget);
  }
}

describe('resume ahead', () => {
  it('never fires on opening, focusing or reconnecting a notebook', () => {
    const model = new FakeModel();
    const tracker = new FakeTracker();
    const a = new FakeNotebook('a');
    const b = new FakeNotebook('b');
    tracker.currentWidget = a as unknown as SessionWidget;
    const follower = new KernelFollower(model as unknown as GpuPoolModel, [tracker]);
    tracker.show(b);
    tracker.show(a);
    a.sessionContext.session = { kernel: { id: 'a2' } };
    a.sessionContext.kernelChanged.emit(null); // reconnected to another kernel
    expect(model.kernelId).toBe('a2');
    expect(model.asked).toEqual([]);
    follower.dispose();
  });

  it('never fires for a cell typed key by key that begins with %', () => {
    const model = new FakeModel();
    const tracker = new FakeTracker();
    const a = new FakeNotebook('a');
    const follower = new KernelFollower(model as unknown as GpuPoolModel, [tracker]);
    tracker.show(a);
    a.type('%gpupool status');
    a.run();
    expect(model.asked).toEqual([]);
    follower.dispose();
  });

  it('fires when another cell is edited, the first time with a fresh read', () => {
    const model = new FakeModel();
    const tracker = new FakeTracker();
    const a = new FakeNotebook('a');
    const follower = new KernelFollower(model as unknown as GpuPoolModel, [tracker]);
    tracker.show(a);
    a.type('%gpupool status');
    a.run();
    a.type('x = 1');
    expect(model.asked.length).toBe(5);
    expect(model.asked[0]).toEqual(['a', true]);
    expect(model.asked.slice(1).every(([id, fresh]) => id === 'a' && !fresh)).toBe(true);
    follower.dispose();
  });

  it('tells looking from working by the cell text', () => {
    expect(editWantsGpu('%gpupool status')).toBe(false);
    expect(editWantsGpu('  %gpupool')).toBe(false);
    expect(editWantsGpu('%')).toBe(false);
    expect(editWantsGpu('x = 1')).toBe(true);
    expect(editWantsGpu('')).toBe(false);
    expect(editWantsGpu('# %gpupool')).toBe(true);
  });
});
