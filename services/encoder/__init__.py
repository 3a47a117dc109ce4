"""The media encoder service (issue 18, EPD): a gRPC shell (``servicer``: the scheduling loop and
the ``Encoder`` service; ``cli``: the process) over the sans-IO core in ``swaserve.encoder``, its
wire format (``wire``), client (``client``) and metrics (``metrics``)."""
