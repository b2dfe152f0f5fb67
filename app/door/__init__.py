"""The door: what every request passes before it reaches a tab — the server and its arguments (`server`), who asks
and what they may do (`access`, `policy`), the routes Gradio serves itself (`guard`), the server's limits (`limits`),
deleting old runs and uploads (`cleanup`) and where runs are kept across restarts (`persist`).

It sits below the tabs: nothing here imports a tab; the server is handed the page it serves (by `app.serve`)."""
