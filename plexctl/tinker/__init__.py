"""The Tinker API front end: an HTTP server that the unmodified ``tinker`` SDK (0.38.0) talks to.

``backend`` is what a cluster implements (``Backend``), ``wire`` converts between the SDK's JSON
and protobuf forms and the backend's types, ``server`` holds the routes, the futures and the
per-model ordering. ``client`` is what SDK users import (a full fine-tuning training client);
``proxy`` forwards a fixed address to wherever the cluster's front end listens. Importing this
package imports nothing heavy; ``server`` needs the ``tinker`` extra (fastapi, uvicorn, the SDK
whose ``tinker.proto`` schema it speaks).
"""
