set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2/run-microbatch2/efficiency_vs_nodes.png'
set title 'Parallel efficiency'
set xlabel 'nodes'
set ylabel 'efficiency'
set yrange [0:*]
set grid
set key bottom left
set xtics 1
plot 'docs/results/openllama-3b-h200x2/run-microbatch2/plots/by_nodes.dat' index 0 using 1:3 with linespoints lw 2 pt 7 title 'load=8'
