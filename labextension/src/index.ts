/**
 * jupyter-gpupool's JupyterLab / Notebook 7 extension: a right-sidebar panel and a
 * status-bar item showing the current kernel's GPU slice, its use, the queue and the pool.
 *
 * Every shell-specific token is optional, so the same plugin runs in JupyterLab and
 * Notebook 7 (no ILabShell).
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, IToolbarWidgetRegistry } from '@jupyterlab/apputils';
import { IConsoleTracker } from '@jupyterlab/console';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Widget } from '@lumino/widgets';

import { GpuPoolClient } from './api';
import { ISessionTracker, KernelFollower } from './follow';
import { gpuIcon } from './icon';
import { GpuPoolModel } from './model';
import { GpuPoolNotifier } from './notifications';
import { GpuPoolPanel } from './panel';
import { GpuPoolStatus } from './statusbar';
import { IGpuPoolModel } from './tokens';
import { parseDuration } from './units';

export { GpuPoolModel } from './model';
export { IGpuPoolModel } from './tokens';

const PLUGIN_ID = 'jupyter-gpupool:plugin';

/** The top-bar item's name in the schema's `jupyter.lab.toolbars.TopBar`. */
const TOP_BAR_ITEM = 'gpupool';

namespace CommandIDs {
  export const open = 'gpupool:open-panel';
  export const keep = 'gpupool:keep';
  export const release = 'gpupool:release';
  export const suspend = 'gpupool:suspend';
  export const resume = 'gpupool:resume';
}

interface ISettings {
  refreshInterval: number;
  keepDuration: string;
  showNotifications: boolean;
  resumeAhead: boolean;
}

const DEFAULTS: ISettings = {
  refreshInterval: 1000,
  keepDuration: '1h',
  showNotifications: true,
  resumeAhead: true
};

const plugin: JupyterFrontEndPlugin<GpuPoolModel> = {
  id: PLUGIN_ID,
  description: 'Shows the GPU slice of the current kernel, the queue and the GPU pool.',
  autoStart: true,
  provides: IGpuPoolModel,
  optional: [
    INotebookTracker,
    IConsoleTracker,
    IStatusBar,
    ILayoutRestorer,
    ICommandPalette,
    ISettingRegistry,
    IToolbarWidgetRegistry,
    ILabShell
  ],
  activate: (
    app: JupyterFrontEnd,
    notebooks: INotebookTracker | null,
    consoles: IConsoleTracker | null,
    statusBar: IStatusBar | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    settingRegistry: ISettingRegistry | null,
    toolbarRegistry: IToolbarWidgetRegistry | null,
    labShell: ILabShell | null
  ): GpuPoolModel => {
    const settings: ISettings = { ...DEFAULTS };
    // One websocket for the page, opened by JupyterLab itself (/api/events/subscribe).
    const events = app.serviceManager.events ?? null;
    const model = new GpuPoolModel({
      client: new GpuPoolClient(app.serviceManager.serverSettings),
      events,
      interval: settings.refreshInterval
    });

    const keepDuration = () => settings.keepDuration;
    const panel = new GpuPoolPanel(model, { keepDuration });
    app.shell.add(panel, 'right', { rank: 900, type: 'GPU Pool' });
    if (restorer) {
      restorer.add(panel, 'jupyter-gpupool-panel');
    }
    const openPanel = () => {
      app.shell.activateById(panel.id);
    };

    const trackers = [notebooks, consoles].filter(
      (t): t is NonNullable<typeof t> => !!t
    ) as unknown as ISessionTracker[];
    new KernelFollower(model, trackers, { resumeAhead: () => settings.resumeAhead });
    new GpuPoolNotifier(model, {
      enabled: () => settings.showNotifications,
      keepDuration,
      openPanel
    });

    addCommands(app, model, settings, openPanel, palette);
    addStatusItems(model, openPanel, statusBar, toolbarRegistry, labShell);
    if (settingRegistry) {
      followSettings(app, model, settings, settingRegistry);
    }
    return model;
  }
};

/** The commands (open the panel; keep, release, suspend, resume the slice), in the palette too. */
function addCommands(
  app: JupyterFrontEnd,
  model: GpuPoolModel,
  settings: ISettings,
  openPanel: () => void,
  palette: ICommandPalette | null
): void {
  app.commands.addCommand(CommandIDs.open, {
    label: 'Show GPU Pool',
    caption: 'Show the GPU slice of the current kernel, the queue and the pool',
    icon: gpuIcon,
    execute: openPanel
  });
  /** Run `action` on the current kernel, if there is one. */
  const onKernel = (action: (kernelId: string) => Promise<void>) => async () => {
    if (model.kernelId) {
      await action(model.kernelId);
    }
  };
  app.commands.addCommand(CommandIDs.keep, {
    label: () => `Keep the Kernel's GPU Slice Through Idle (${settings.keepDuration})`,
    isEnabled: () => model.view.canKeep,
    execute: onKernel(id => model.keep(id, settings.keepDuration))
  });
  app.commands.addCommand(CommandIDs.release, {
    label: "Release the Kernel's GPU Slice",
    isEnabled: () => model.view.canRelease,
    execute: onKernel(id => model.release(id))
  });
  app.commands.addCommand(CommandIDs.suspend, {
    label: "Suspend the Kernel's GPU Slice (Variables Kept)",
    caption: 'Park the GPU memory in host RAM; the next cell resumes it',
    isEnabled: () => model.view.canSuspend,
    execute: onKernel(id => model.suspend(id))
  });
  app.commands.addCommand(CommandIDs.resume, {
    label: "Resume the Kernel's GPU Slice",
    caption: 'Queue a suspended kernel for a GPU now',
    isEnabled: () => model.view.canResume,
    execute: onKernel(id => model.resume(id))
  });
  if (palette) {
    const category = 'GPU Pool';
    const commands = [CommandIDs.open, CommandIDs.keep, CommandIDs.release, CommandIDs.suspend, CommandIDs.resume];
    for (const command of commands) {
      palette.addItem({ command, category });
    }
  }
}

/** The slice in JupyterLab's status bar, or in the top bar where there is none (Notebook 7). */
function addStatusItems(
  model: GpuPoolModel,
  openPanel: () => void,
  statusBar: IStatusBar | null,
  toolbarRegistry: IToolbarWidgetRegistry | null,
  labShell: ILabShell | null
): void {
  if (statusBar) {
    const item = new GpuPoolStatus(model, openPanel);
    statusBar.registerStatusItem(PLUGIN_ID + ':status', {
      item,
      align: 'left',
      rank: 3,
      isActive: () => item.hasText,
      activeStateChanged: model.changed
    });
  }

  if (toolbarRegistry) {
    // The page's top bar (schema: jupyter.lab.toolbars.TopBar): Notebook 7 has no status
    // bar, so this is where its users see their kernel's slice, as with
    // jupyter-resource-usage. JupyterLab shows the status-bar item instead.
    const inTopBar = !labShell || !statusBar;
    toolbarRegistry.addFactory('TopBar', TOP_BAR_ITEM, () => {
      if (!inTopBar) {
        const placeholder = new Widget();
        placeholder.hide();
        return placeholder;
      }
      const item = new GpuPoolStatus(model, openPanel, { hideWhenEmpty: true });
      item.addClass('jp-GpuPool-topBar');
      return item;
    });
  }
}

/** Apply the user's settings once the app is restored, and again whenever they change. */
function followSettings(
  app: JupyterFrontEnd,
  model: GpuPoolModel,
  settings: ISettings,
  settingRegistry: ISettingRegistry
): void {
  const apply = (loaded: ISettingRegistry.ISettings) => {
    const composite = loaded.composite as Partial<ISettings>;
    settings.refreshInterval =
      typeof composite.refreshInterval === 'number'
        ? composite.refreshInterval
        : DEFAULTS.refreshInterval;
    let keep = String(composite.keepDuration ?? DEFAULTS.keepDuration);
    try {
      parseDuration(keep);
    } catch (error) {
      console.warn(`jupyter-gpupool: keepDuration: ${(error as Error).message}; using 1h`);
      keep = DEFAULTS.keepDuration;
    }
    settings.keepDuration = keep;
    settings.showNotifications = composite.showNotifications !== false;
    settings.resumeAhead = composite.resumeAhead !== false;
    model.interval = settings.refreshInterval;
    app.commands.notifyCommandChanged(CommandIDs.keep);
    void model.refresh();
  };
  void Promise.all([settingRegistry.load(PLUGIN_ID), app.restored])
    .then(([loaded]) => {
      apply(loaded);
      loaded.changed.connect(apply);
    })
    .catch(reason => {
      console.warn('jupyter-gpupool: cannot load settings', reason);
    });
}

export default plugin;
