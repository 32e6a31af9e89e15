"""The sandboxes' and builds' way out: a real HTTP(S) proxy (mitmproxy) with a policy, a cache and mirrors.

A sandbox whose task has the network joins the ``agentrl-egress`` Docker network, which has no route
out: the only address it reaches is the proxy's, on the network's bridge. Builds get the proxy as
Docker's predefined ``HTTP_PROXY``/``HTTPS_PROXY`` build arguments. Each sandbox and build has its
own proxy credentials (a session: task, phase, allowed hosts), so every request is checked against
that session's policy and recorded under it.

- ``policy``: the pure rules (host patterns, which URLs are versioned artifacts, mirror matching);
  stdlib only, imported by the proxy's addon too.
- ``ca``: the proxy's certificate authority (made once per machine) and the bundle sandboxes trust.
- ``mirrors``: what a declared mirror serves (uv's installer and release archives from PyPI's wheel,
  a folder, another base URL).
- ``addon``: the mitmproxy addon (runs in the proxy's own venv).
- ``proxy``: the proxy process, its sessions and the per-session record (``EgressProxy``).
"""
