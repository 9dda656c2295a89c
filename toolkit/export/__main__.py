from toolkit.export import main

main()
