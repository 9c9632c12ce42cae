from services.elastic.service import main

main()
