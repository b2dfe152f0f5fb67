"""The fine-tuning GUI: a Gradio app that is a thin client of the `finetune` CLI (`python -m app`, `finetune ui`).

One package per tab of the page (`train`, `tryit`, `runs`, `export`), each building its own widgets and wiring its
own events, over one small shared state (`state.AppState`): the request policy every event and route asks
(`policy`), the job client behind every child process (`jobs`), the server's limits and the downloads. `page` builds
the page, `tabs` the handlers of every tab, `api` the scripting API; docs/gui.md lists the modules.
"""
