// JupyterLab side of jupyter-pagedkv: a "KV cache" side panel with the live block map of the
// active notebook's kernel, and a status-bar item ("KV 43% · 12 running"). Both read one comm
// per kernel to the target that `%load_ext jupyter_pagedkv` registers; the drawing code is the
// notebook widget's own module (jupyter_pagedkv/widgets/static/blockmap.js).
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';
import { mount, statusText, View } from '../../jupyter_pagedkv/widgets/static/blockmap.js';

const TARGET = 'jupyter_pagedkv.monitor';
const PANEL_ID = 'jupyter-pagedkv-panel';
const RETRY_MS = 2000;

const icon = new LabIcon({
  name: 'jupyter-pagedkv:blocks',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><g class="jp-icon3" fill="#616161">' +
    '<rect x="1" y="1" width="6" height="6"/><rect x="9" y="1" width="6" height="6"/>' +
    '<rect x="1" y="9" width="6" height="6"/><rect x="9" y="9" width="6" height="6" opacity=".4"/></g></svg>'
});

type Listener = (frame: Record<string, any>) => void;

/** One comm to the current notebook's kernel, re-opened when the kernel or the notebook changes
 * and retried until the kernel has the target (i.e. until `%load_ext jupyter_pagedkv` ran). */
class KernelLink {
  private kernel: Kernel.IKernelConnection | null = null;
  private comm: Kernel.IComm | null = null;
  private loaded = false;
  private listeners = new Set<Listener>();
  private timer: number;

  constructor() {
    this.timer = window.setInterval(() => this.tick(), RETRY_MS);
  }

  onFrame(listener: Listener): void {
    this.listeners.add(listener);
  }

  setKernel(kernel: Kernel.IKernelConnection | null): void {
    if (kernel === this.kernel) {
      return;
    }
    this.closeComm();
    this.kernel = kernel;
    this.emit({ loaded: false });
    this.tick();
  }

  private tick(): void {
    const k = this.kernel;
    if (!k || k.isDisposed || k.status === 'dead' || k.status === 'restarting') {
      this.closeComm();
      return;
    }
    if (!this.comm) {
      this.open(k);
    } else if (!this.loaded) {
      this.comm.send({ request: 'subscribe', diffs: true });
    }
  }

  private open(k: Kernel.IKernelConnection): void {
    let comm: Kernel.IComm;
    try {
      comm = k.createComm(TARGET);
    } catch {
      return;
    }
    this.comm = comm;
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this.receive(msg);
    comm.onClose = () => {
      if (this.comm === comm) {
        this.comm = null;
        this.loaded = false;
      }
    };
    comm.open({});
    comm.send({ request: 'subscribe', diffs: true });
  }

  private receive(msg: KernelMessage.ICommMsgMsg): void {
    const data = { ...(msg.content.data as Record<string, any>) };
    if (data.response !== 'frame') {
      return;
    }
    const names: string[] = data.buffers || [];
    names.forEach((name, i) => (data[name] = msg.buffers ? msg.buffers[i] : undefined));
    this.loaded = data.loaded !== false;
    this.emit(data);
  }

  private emit(frame: Record<string, any>): void {
    this.listeners.forEach(l => l(frame));
  }

  private closeComm(): void {
    const comm = this.comm;
    this.comm = null;
    this.loaded = false;
    if (comm && !comm.isDisposed) {
      try {
        comm.close();
      } catch {
        // the kernel is already gone
      }
    }
  }

  dispose(): void {
    window.clearInterval(this.timer);
    this.closeComm();
  }
}

/** The side panel: the shared block map, or a note saying how to get one. */
class MonitorPanel extends Widget {
  private view: View;
  private note: HTMLElement;

  constructor(link: KernelLink) {
    super();
    this.id = PANEL_ID;
    this.addClass('pkv-panel');
    this.title.icon = icon;
    this.title.caption = 'KV cache';
    this.title.label = 'KV cache';
    this.note = document.createElement('div');
    this.note.className = 'pkv-panel-note';
    this.node.appendChild(this.note);
    const host = document.createElement('div');
    this.node.appendChild(host);
    this.view = mount(host, { title: 'KV cache', height: 420 });
    this.setNote(true);
    link.onFrame(frame => this.receive(frame));
  }

  private setNote(visible: boolean): void {
    this.note.textContent = visible
      ? 'No engine in this notebook’s kernel yet: run %load_ext jupyter_pagedkv and %pagedkv load.'
      : '';
    this.note.style.display = visible ? '' : 'none';
  }

  private receive(frame: Record<string, any>): void {
    if (frame.loaded === false) {
      this.view.apply({ closed: true });
      this.setNote(true);
      return;
    }
    this.setNote(false);
    if (frame.full && frame.model) {
      this.view.setTitle(`KV cache · ${frame.model} · ${frame.num_blocks.toLocaleString()} blocks × ${frame.block_size}`);
    }
    this.view.apply(frame);
  }
}

/** The status-bar item: "KV 43% · 12 running" while an engine is loaded. */
class StatusItem extends Widget {
  constructor(link: KernelLink) {
    super();
    this.addClass('pkv-status');
    this.node.textContent = '';
    this.node.title = 'jupyter-pagedkv: KV-cache usage and running requests of this kernel';
    link.onFrame(frame => {
      this.node.textContent = frame.loaded === false ? '' : statusText(frame.gauges);
    });
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyter-pagedkv:monitor',
  description: 'KV cache side panel and status bar item for jupyter-pagedkv kernels',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker, statusBar: IStatusBar | null) => {
    const link = new KernelLink();
    const panel = new MonitorPanel(link);
    app.shell.add(panel, 'right', { rank: 900 });
    if (statusBar) {
      statusBar.registerStatusItem('jupyter-pagedkv:status', {
        item: new StatusItem(link),
        align: 'left',
        rank: 5,
        isActive: () => true
      });
    }
    let watched: NotebookPanel | null = null;
    const follow = () => {
      const nb = tracker.currentWidget;
      if (watched && watched !== nb) {
        watched.sessionContext.kernelChanged.disconnect(update);
      }
      if (nb && nb !== watched) {
        nb.sessionContext.kernelChanged.connect(update);
      }
      watched = nb;
      update();
    };
    const update = () => link.setKernel(watched?.sessionContext.session?.kernel ?? null);
    tracker.currentChanged.connect(follow);
    follow();
    app.commands.addCommand('jupyter-pagedkv:show-monitor', {
      label: 'Show KV cache monitor',
      execute: () => app.shell.activateById(PANEL_ID)
    });
  }
};

export default plugin;
