"""The live monitor's data: the feed of pool frames and the kernel comm channel the JupyterLab
panel talks to. It reads an engine only through `EngineClient`."""
