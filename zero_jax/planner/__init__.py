"""Choosing a layout for a cluster without the cluster: device kinds as data,
the candidate layouts, their analytic cost, and the search that compiles the
best of them."""
