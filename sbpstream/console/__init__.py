"""The web console: static HTML, JS and CSS served by the PM's admin port (no build step, no CDN).

The pages read the ``/v1/...`` JSON routes (:mod:`sbpstream.introspect.http`) and render every
value from the cluster with ``textContent``, never as HTML.
"""
