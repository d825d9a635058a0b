// Types of blockmap.js for the labextension's TypeScript build (the module itself is plain JS).
export interface Store {
  seq: number;
  numBlocks: number;
  blockSize: number;
  legend: string[];
  codes: Uint8Array;
  refs: Uint8Array;
  owners: Map<number, string[]>;
  tenants: Map<number, string[]>;
  gauges: Record<string, any> | null;
  history: number[];
  closed: boolean;
}
export type ApplyResult = 'ok' | 'stale' | 'gap' | 'skip';
export interface View {
  store: Store;
  setTitle(text: string): void;
  setMode(mode: 'state' | 'tenant'): void;
  apply(frame: Record<string, any> | null | undefined): ApplyResult;
  dispose(): void;
}
export const COLORS: Record<string, [number, number, number]>;
export function colorOf(state: string): [number, number, number];
export function createStore(): Store;
export function applyFrame(store: Store, frame: Record<string, any> | null | undefined): ApplyResult;
export function statusText(gauges: Record<string, any> | null | undefined): string;
export function mount(el: HTMLElement, opts?: { title?: string; height?: number; mode?: 'state' | 'tenant' }): View;
declare const widget: { render(args: { model: any; el: HTMLElement }): () => void };
export default widget;
