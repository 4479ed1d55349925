"""The web console: static HTML, JS and CSS served by the PM's admin port (no build step, no CDN).

The pages read the ``/v1/...`` JSON routes (:mod:`sbpstream.introspect.http`) and render every
value from the cluster with ``textContent``, never as HTML. With auth on they show a login form
first: ``POST /v1/login`` answers a bearer token, kept in the page's memory only (no
localStorage, no cookie) and sent on every fetch.
"""
