"""Engine replicas on Ray Serve behind the router (`radixkv serve --replicas N`).

`router_service` is the router's HTTP side over abstract replica clients; `asgi_call` runs a
forwarded request through a replica's server application in process; `deployment` is the Ray
Serve application; `launch` the command. Only `deployment` and `launch.run` import Ray (the
`cluster` extra); nothing here is imported by `radixkv --help`.
"""
