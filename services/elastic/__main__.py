from gpuherd.runtime.shell import main
from services.elastic.spec import SPEC

main(SPEC)
