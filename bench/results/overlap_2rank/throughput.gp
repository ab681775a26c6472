set terminal pngcairo size 960,540 font ',11'
set output 'bench/results/overlap_2rank/throughput.png'
set title 'dhp bench: throughput by vision length (2 processes)'
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set boxwidth 0.9
set ylabel 'vision patches / s'
set xlabel 'vision patches per image'
set yrange [0:2663.32]
set key top left
set grid ytics
plot 'bench/results/overlap_2rank/throughput.dat' using 2:xtic(1) title 'dp_overlap', '' using 3 title 'dp_end', '' using 4 title 'zero3_overlap', '' using 5 title 'zero3_end', '' using 6 title 'dhp_overlap', '' using 7 title 'dhp_end'
