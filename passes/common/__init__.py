"""Not passes: what the passes share. The tensor code they splice in (``collective_code``,
``secondary_code``, ``quantized_code``, ``host_copies``), how it is traced in
(``splice``), the copy of forward nodes into the backward (``backward_copies``), the call
``update_in_graph`` puts after each bucket's reduction (``update_code``), and the node
predicates every pass is specialised by (``predicates``)."""
