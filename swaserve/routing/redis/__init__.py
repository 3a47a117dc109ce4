"""The routing core's interfaces in Redis: prefix index and load book (``store``), the precise-mode
event stream (``events``) and the worker registry (``registry``). The only part of
``swaserve.routing`` that does I/O."""
