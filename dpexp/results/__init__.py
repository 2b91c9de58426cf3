"""Results: the store indexing every run record (:mod:`.store`), the experiments that reproduce the papers'
tables (:mod:`.experiments`, ``conf/experiment/*.yaml``) and the tables and figures rendered from the store
beside the published numbers (:mod:`.tables`). ``python -m dpexp.reproduce`` drives them."""
