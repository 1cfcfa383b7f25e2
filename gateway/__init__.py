"""SplitSpec gateway: the client-facing service (``python -m gateway --help``).

Module map:

- ``app``: start-up steps (load_config .. warmup), health gate, ``main``.
- ``config``: the frozen GatewayConfig; the command line is built from it.
- ``servicer``: gRPC Gateway servicer; proto in, GatewayCore call, proto out.
- ``core``: GatewayCore: validate, enqueue, start a RequestRun; GetStatus figures.
- ``validation``: GenerateRequest -> GenerationRequest, or INVALID_ARGUMENT saying why.
- ``admission``: max_running slots and a FIFO queue of max_queued; RESOURCE_EXHAUSTED past it.
- ``generation``: RequestRun, one request from admission to its last chunk; cancellation.
- ``text_stream``: token ids -> text: incremental detokenization, stop strings with hold-back.
- ``target_client``: connect and check the target; the one Serve stream; reconnection.
- ``policy``: the speculation policy table sent to the target.
- ``stats``: speculation statistics summed over finished requests.
"""
